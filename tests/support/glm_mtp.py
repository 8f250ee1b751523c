"""Tiny GLM targets (`glm4_moe`: GLM-4.5/4.6/4.7; `glm4_moe_lite`: GLM-4.7-Flash) that ship
their own MTP layers as the released checkpoints do (REFERENCES part D, D):
`model.layers.{L+k}.{enorm, hnorm, eh_proj, shared_head.{norm, head}, embed_tokens}` plus a whole
decoder block of the family under the same prefix (routed experts per expert),
`num_nextn_predict_layers = n` in config.json.

The oracle (`GlmMTPOracle`) is vLLM's GLM MTP layer (`glm4_moe_mtp.py`,
`glm4_moe_lite_mtp.py`: `eh_proj(cat[enorm(emb), hnorm(h)])`, the block, `shared_head.norm`
before the head) around transformers' own decoder layer of the family. transformers 5.24
models GLM-4.5's MTP layer (`Glm4MoeConfig.num_mtp_layers`, `MtpModel`) but not
GLM-4.7-Flash's (`Glm4MoeLiteConfig` has no MTP field, and `get_mtp_config` refuses its
`mlp_layer_types` without `mtp_mlp_layer_types`), so one oracle serves both: transformers'
layer classes, the MTP wrapper written here from vLLM's forward. Its tensors are written to the
target's files under the released names by `drafttrain.zoo.mtp_joint.released_names` (the
inverse of transformers' MTP conversion, experts per expert), not by our layouts.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import torch
from torch import nn

from drafttrain.zoo.mtp_joint import released_names
from tests.support.moe_checkpoints import save_moe_target


def _classes(config):
    """(decoder layer, RMSNorm, rotary) classes of `config`'s family in transformers."""
    module = importlib.import_module(
        f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    )
    prefix = {"glm4_moe": "Glm4Moe", "glm4_moe_lite": "Glm4MoeLite"}[config.model_type]
    return (
        getattr(module, f"{prefix}DecoderLayer"),
        getattr(module, f"{prefix}RMSNorm"),
        getattr(module, f"{prefix}RotaryEmbedding"),
    )


class _Layer(nn.Module):
    def __init__(self, block: nn.Module, norm, H: int, eps: float):
        super().__init__()
        self.enorm, self.hnorm = norm(H, eps), norm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.mtp_block = block
        self.post_norm = norm(H, eps)  # `shared_head.norm` in the released names


class GlmMTPOracle(nn.Module):
    """`n` MTP layers of the family of `config` (a transformers config), each a routed layer
    of the family (transformers' own class), in `MtpModel`'s state-dict names
    (`layers.{k}.{enorm, hnorm, eh_proj, mtp_block.*, post_norm}`)."""

    def __init__(self, config, n: int):
        super().__init__()
        layer_cls, norm, rotary = _classes(config)
        c = copy.deepcopy(config)
        c._attn_implementation = "eager"
        if getattr(c, "mlp_layer_types", None) is not None:
            c.mlp_layer_types = ["sparse"] * n  # an MTP layer routes (the released layer 47)
        if hasattr(c, "first_k_dense_replace"):
            c.first_k_dense_replace = 0
        H, eps = c.hidden_size, c.rms_norm_eps
        self.layers = nn.ModuleList(_Layer(layer_cls(c, k), norm, H, eps) for k in range(n))
        self.rotary_emb = rotary(c)

    def pre_norm(
        self, k: int, emb: torch.Tensor, h: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """Module k over whole rows (causal): emb, h `[B, T, H]` (the embedding at position 0
        already zeroed), pos `[B, T]` -> the block's output `[B, T, H]` before
        `shared_head.norm` (what vLLM returns and carries)."""
        layer = self.layers[k]
        T = emb.shape[1]
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], -1))
        out = layer.mtp_block(
            x,
            attention_mask=torch.full((T, T), float("-inf")).triu(1)[None, None],
            position_embeddings=self.rotary_emb(x, pos),
            position_ids=pos,
        )
        return out[0] if isinstance(out, tuple) else out


def save_glm_with_mtp(
    config, path: Path, n_mtp: int = 1, seed: int = 0
) -> tuple[Path, GlmMTPOracle]:
    """`config` (a `Glm4MoeConfig` / `Glm4MoeLiteConfig`) saved at `path` as a random target
    (`save_moe_target`) shipping `n_mtp` MTP layers in its own `model.safetensors` (module
    docstring) -> (path, the oracle holding those layers' tensors). The layers' tensors are
    redrawn (routers wide, for decisive routes; the correction bias of order the scores; norms
    near 1)."""
    from safetensors.torch import load_file, save_file

    save_moe_target(config, path, seed)
    torch.manual_seed(seed + 7)
    oracle = GlmMTPOracle(config, n_mtp).float().eval()
    g = torch.Generator().manual_seed(seed + 8)
    with torch.no_grad():
        for name, t in oracle.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                t.copy_(torch.randn(t.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
            elif t.dim() == 1:
                t.copy_(1.0 + 0.3 * torch.rand(t.shape, generator=g))
            elif t.is_floating_point():
                t.copy_(0.15 * torch.randn(t.shape, generator=g))
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    L = config.num_hidden_layers
    state = {k: v for k, v in oracle.state_dict().items() if not k.startswith("rotary_emb.")}
    released = released_names(state, L)
    for k in range(n_mtp):
        released[f"model.layers.{L + k}.shared_head.head.weight"] = tensors["lm_head.weight"]
        released[f"model.layers.{L + k}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors.update({k: v.clone().contiguous() for k, v in released.items()})
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = n_mtp
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path, oracle
