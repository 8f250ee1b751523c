"""Multi-layer MTP drafter: N distinct modules; one definition for training and the runner.

Module k (convention 5): `h_k = block_k(eh_proj_k(cat[enorm_k(embed(t)), hnorm_k(h_in)]))`
(embedding first; hidden first for the `mrv2` layout, Inkling's `[hidden_norm(h) ‖
embed_norm(emb)]`), then a per-module final norm (`norm`, DeepSeek's `shared_head.norm`; the
`mrv2` layout shares one, Inkling's `chain_norm`) before the target's shared, frozen `lm_head`. `h_in` is the target's final hidden state for
module 0, and for module k+1 module k's output (`mtp_chain`; its pre- or post-norm state per
`mtp_carry`) or again the target's feature (no chain).

Rows (convention 1, extended by depth): module k at row i consumes token `t_{i+k+1}` at RoPE
position `pos_i + k` (`mrv2`: `pos_i`; `config.module_positions`) and predicts `t_{i+k+2}`. Every module keeps its own KV cache in the
runner, indexed by the row (the target token index `i`), while RoPE reads `pos_i + k`.

`embed_tokens` and `lm_head` are the target's, frozen and never part of the drafter's own
state (`trainable_state_dict`); engines share the target's (DeepSeek checkpoints also carry
copies, which the export writes).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from draftinfer.conventions.window import TokenEmbeds, token_embeddings
from draftinfer.kinds.mtp.config import MTPConfig
from draftinfer.models.layers import AttnFn, DecoderLayer, RMSNorm, head_logits
from draftinfer.models.rope import RotaryEmbedding


def hf_layer_classes(cfg: MTPConfig):
    """(decoder-layer class, rotary class, config) of the target family in transformers, for
    `block: hf`: the classes transformers' own `MtpModel` builds its layers from."""
    import transformers

    model_cls = getattr(transformers, cfg.architecture)
    module = importlib.import_module(model_cls.__module__)
    layer_cls = next(v for k, v in vars(module).items() if k.endswith("DecoderLayer"))
    rotary_cls = next(v for k, v in vars(module).items() if k.endswith("RotaryEmbedding"))
    hf = transformers.AutoConfig.for_model(**cfg.target_config)
    hf.num_nextn_predict_layers = cfg.n_predict
    if hasattr(hf, "get_mtp_config") and getattr(hf, "num_mtp_layers", None):
        hf = hf.get_mtp_config()
    hf._attn_implementation = "eager"
    return layer_cls, rotary_cls, hf


class MTPLayer(nn.Module):
    """One MTP module: enorm, hnorm, eh_proj `[H, 2H]`, a decoder block, a final norm (none
    when the layout shares one `chain_norm` across modules)."""

    def __init__(self, c: MTPConfig, k: int, block: nn.Module, eps: float):
        super().__init__()
        H = c.hidden_size
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = block
        if not c.shared_norm:
            self.norm = RMSNorm(H, eps)


class MTPDrafter(nn.Module):
    def __init__(self, config: MTPConfig):
        super().__init__()
        c = self.config = config
        H, V = c.hidden_size, c.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.hf_rotary = None
        if c.block == "native":
            blocks = [DecoderLayer(c) for _ in range(c.n_predict)]
            eps = c.rms_norm_eps
            self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        else:
            layer_cls, rotary_cls, hf = hf_layer_classes(c)
            blocks = [layer_cls(hf, k) for k in range(c.n_predict)]
            eps = float(getattr(hf, "rms_norm_eps", 1e-6))
            self.hf_rotary = rotary_cls(hf)
        self.layers = nn.ModuleList(MTPLayer(c, k, b, eps) for k, b in enumerate(blocks))
        # Inkling's `chain_norm`: one final norm whose output is every module's head input.
        self.chain_norm = RMSNorm(H, eps) if c.shared_norm else None

    def final_norm(self, k: int) -> nn.Module:
        """Module k's final norm (its own, or the shared `chain_norm`)."""
        return self.chain_norm if self.chain_norm is not None else self.layers[k].norm

    def draft_vocab_ids(self) -> torch.Tensor:
        """MTP drafts over the target's whole vocabulary."""
        return torch.arange(self.config.vocab_size, device=self.lm_head.weight.device)

    def forward(
        self,
        k: int,
        input_ids: torch.Tensor,
        h_in: torch.Tensor,
        rope_pos: torch.Tensor,
        attn_fn: AttnFn,
        mm: TokenEmbeds | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Module k over rows: input_ids `[B, T]` (the token each row consumes), h_in
        `[B, T, H]`, rope_pos `[B, T]` / `[3, B, T]`, mm: the target's input embeddings of the
        rows whose consumed token is a multimodal placeholder (convention 3) -> (normed,
        pre-norm), both `[B, T, H]`."""
        layer = self.layers[k]
        emb = token_embeddings(self.embed_tokens, input_ids, mm).to(h_in.dtype)
        if self.config.mask_pos0_embedding:
            at0 = rope_pos == 0 if rope_pos.dim() == input_ids.dim() else (rope_pos == 0).all(0)
            emb = torch.where(at0[..., None], torch.zeros_like(emb), emb)
        e, h = layer.enorm(emb), layer.hnorm(h_in)
        x = layer.eh_proj(torch.cat([h, e] if self.config.hidden_first else [e, h], dim=-1))
        if self.hf_rotary is None:
            cos, sin = self.rotary(rope_pos)
            pre = layer.block(x, cos, sin, attn_fn, k)
        else:  # the family's own layer, training only: plain causal attention over the rows
            T = x.shape[1]
            causal = torch.full((T, T), float("-inf"), device=x.device).triu(1)
            out = layer.block(
                x,
                attention_mask=causal.to(x.dtype)[None, None].expand(x.shape[0], 1, T, T),
                position_embeddings=self.hf_rotary(x, rope_pos),
                position_ids=rope_pos,
            )
            pre = out[0] if isinstance(out, tuple) else out
        return self.final_norm(k)(pre), pre

    def carry(self, normed: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """What module k hands module k+1 when chained (`mtp_carry`)."""
        return pre if self.config.mtp_carry == "pre_norm" else normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """`[..., H]` -> full-vocabulary logits `[..., V]` (the target's shared head)."""
        return head_logits(self.lm_head, normed)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The modules only: the shared embedding and head belong to the target."""
        skip = ("embed_tokens.", "lm_head.")
        return {k: v for k, v in self.state_dict().items() if not k.startswith(skip)}

    def load_own_state(self, tensors: dict[str, torch.Tensor]) -> None:
        shared = {
            "embed_tokens.weight": self.embed_tokens.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        self.load_state_dict({**tensors, **shared})
