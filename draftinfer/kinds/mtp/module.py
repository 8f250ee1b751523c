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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from draftinfer.conventions.slots import Slots
from draftinfer.conventions.window import TokenEmbeds, token_embeddings
from draftinfer.decoding.proposer import causal_attn
from draftinfer.kinds.mtp.config import MTPConfig
from draftinfer.models.kv_cache import bind_cache, resolve_attn_len, visibility_mask, write_index
from draftinfer.models.layers import AttnFn, DecoderLayer, RMSNorm, head_logits
from draftinfer.models.rope import RotaryEmbedding


@dataclass
class LayerSlots:
    """What a block that is the family's own native layer (`MTPConfig.own_layer`) reads in the
    runner, in place of an `AttnFn`: the arguments a target's layer takes after `(x, cos,
    sin)` (`NativeCausalLM.forward`), over the block's own cache (its attention's buffers,
    `MTPDrafter.allocate_caches`). rows `[B]`, cache_pos `[B, T]` (-1: padding), write_pos
    `[B, T]` (the scratch column for padding), attn_len L; the mask `[B, 1, T * group, L]` is
    built once per (group, window) and shared by the modules."""

    rows: torch.Tensor
    cache_pos: torch.Tensor
    write_pos: torch.Tensor
    attn_len: int
    _masks: dict = field(default_factory=dict)

    def args(self, block: nn.Module, group: int) -> tuple:
        window = getattr(block.self_attn, "window", None)
        if (group, window) not in self._masks:
            self._masks[group, window] = visibility_mask(
                self.cache_pos, self.attn_len, group, window
            )
        return self.rows, self.write_pos, self._masks[group, window], self.attn_len


@contextmanager
def scratch_cache(attn: nn.Module, B: int, T: int, like: torch.Tensor) -> Iterator[None]:
    """The attention `attn` of an own-layer block over a fresh cache of `B` rows x `T` indices
    (its `allocate_cache`), its own buffers (the runner's cache) put back afterwards: how
    training and the reference loop run the block causally over whole rows, gradients flowing
    through the cache writes."""
    saved = dict(attn._buffers)
    attn.allocate_cache(B, T, like.dtype, like.device)
    try:
        yield
    finally:
        for name, buf in saved.items():
            setattr(attn, name, buf)


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
        self.max_seq_len = 0  # of the own-layer blocks' caches (`allocate_caches`)
        if c.block == "native" and c.own_layer:
            # The family's own layer at the index the module sits at in the checkpoint
            # (`model.layers.{L+k}`): the target's attention and MLP kinds, its names.
            cls, native = c.native_layer()
            L = c.target_num_layers
            blocks = [cls.decoder_layer(native, L + k) for k in range(c.n_predict)]
            eps = c.rms_norm_eps
            self.group = native.num_heads // native.num_kv_heads
            self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        elif c.block == "native":
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
            if self.config.own_layer:
                pre = self._own_layer(layer.block, x, cos, sin, attn_fn)
            else:
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

    def _own_layer(self, block, x, cos, sin, attn) -> torch.Tensor:
        """An own-layer block over `x [B, T, H]`: through its cache at `attn`'s slots (the
        runner, `LayerSlots`), or, given plain causal attention (training, the reference
        loop), causally over the whole rows through a scratch cache."""
        if isinstance(attn, LayerSlots):
            return block(x, cos, sin, *attn.args(block, self.group))
        if attn is not causal_attn:
            raise TypeError(
                "an MTP module whose block is the target family's own layer attends through "
                "its own cache (LayerSlots) or causally over whole rows (causal_attn)"
            )
        B, T, _ = x.shape
        pos = torch.arange(T, device=x.device).expand(B, T)
        rows = torch.arange(B, device=x.device)
        with scratch_cache(block.self_attn, B, T, x):
            return block(x, cos, sin, *LayerSlots(rows, pos, pos, T).args(block, self.group))

    def new_caches(
        self, max_batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device
    ) -> list[dict[str, torch.Tensor]]:
        """Own-layer blocks: a fresh cache per module (its attention's `allocate_cache`: MLA's
        latent, `[max_batch, max_seq_len + 1, kv_lora_rank + qk_rope_head_dim]`), written and
        rolled back like the target's (no KV computed from a rejected draft is ever read). The
        proposer owns them and installs them before each call (`use_caches`), so two proposers
        over one drafter never share a cache."""
        caches = []
        for layer in self.layers:
            attn = layer.block.self_attn
            attn.allocate_cache(max_batch, max_seq_len, dtype, device)
            caches.append({k: v for k, v in attn._buffers.items() if v is not None})
        self.max_seq_len = max_seq_len
        return caches

    def use_caches(self, caches: list[dict[str, torch.Tensor]]) -> None:
        """Make `caches` (from `new_caches`) the blocks' caches (assignments, no copy)."""
        for layer, cache in zip(self.layers, caches):
            for name, t in cache.items():
                setattr(layer.block.self_attn, name, t)
        self.max_seq_len = next(iter(caches[0].values())).shape[1] - 1

    def bind(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slots: Slots):
        """What the modules attend through for one forward over `slots`: an `AttnFn` over the
        runner's per-module K/V (`bind_cache`), or, for own-layer blocks, `LayerSlots` over
        the blocks' own caches."""
        if not self.config.own_layer:
            return bind_cache(k_cache, v_cache, slots)
        attn_len = resolve_attn_len(slots, self.max_seq_len)
        write_pos = write_index(slots.cache_pos, self.max_seq_len)
        return LayerSlots(slots.rows, slots.cache_pos, write_pos, attn_len)

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
