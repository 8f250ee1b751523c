"""Oracles and spies for where a drafter's attention layers rotate on a Qwen3-VL target, built
from transformers' own code, never from our position functions: the `[3, N]` table of a token
sequence is transformers' `Qwen3VLModel.get_rope_index` (a weightless model of the target's
config), and a rotation is transformers' `Qwen3VLTextRotaryEmbedding` + `apply_rotary_pos_emb`
with the drafter's `mrope_section` (or its plain `LlamaRotaryEmbedding` for 1-D positions).

    table = hf_table(hf_config, ids, grids)        # [3, len(ids)] for ids with image runs
    cap = AttentionCapture(drafter)                # every `Attention` call: x, rotated q, k
    q_ref, k_ref = hf_rotate(drafter, q0, k0, pos) # q0, k0 unrotated [B, T, heads, D]
"""

from __future__ import annotations

import torch

from draftinfer.models.layers import Attention


def hf_table(hf_config, ids: list[int], grids: list[list[int]]) -> torch.Tensor:
    """transformers' `get_rope_index` of one sequence `ids` whose image runs have `grids`
    -> `[3, len(ids)]` int64."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    with torch.device("meta"):
        model = Qwen3VLModel(hf_config)
    t = torch.tensor([ids])
    mm = (t == hf_config.image_token_id).int()
    pos, _ = model.get_rope_index(t, mm, torch.tensor(grids) if grids else None)
    return pos[:, 0].cpu()


def hf_rotate(d, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor):
    """transformers' Qwen3-VL rotary with the drafter's own `mrope_section` and theta:
    q `[B, T, nq, D]`, k `[B, T, nkv, D]`, pos `[3, B, T]` -> rotated (q, k) fp32."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    c = d.config
    D = q.shape[-1]
    section = list(c.rope_scaling["mrope_section"])
    assert sum(section) == D // 2
    hf = Qwen3VLTextConfig(
        hidden_size=q.shape[-2] * D,
        num_attention_heads=q.shape[-2],
        head_dim=D,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "mrope_section": section,
        },
    )
    cos, sin = Qwen3VLTextRotaryEmbedding(hf)(q, pos)  # [B, T, D]
    return apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=2)


def hf_plain_rope(head_dim: int, theta: float, pos: torch.Tensor):
    """transformers' plain (1-D) Llama rotary: pos `[B, T]` -> (cos, sin) `[B, T, head_dim]`."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    x = torch.zeros(1, dtype=torch.float32)
    return LlamaRotaryEmbedding(cfg)(x, pos)


class AttentionCapture:
    """Every `draftinfer.models.layers.Attention` call of a drafter: the layer's input `x`, and the
    q and k it rotated, taken from the `attn_fn` the layer calls (where RoPE has been applied)."""

    def __init__(self, d):
        self.calls: list[dict] = []
        self.handles = [
            m.register_forward_pre_hook(self._pre) for m in d.modules() if isinstance(m, Attention)
        ]

    def _pre(self, module, args):
        x, cos, sin, attn_fn, idx = args
        call = {"module": module, "x": x.detach().clone()}
        self.calls.append(call)

        def spy(i, q, k, v):
            call["q"], call["k"] = q.detach().clone(), k.detach().clone()
            return attn_fn(i, q, k, v)

        return (x, cos, sin, spy, idx)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def unrotated(call) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k a captured call's layer computes from its input before RoPE `[B, T, h, D]`."""
    m, x = call["module"], call["x"]
    lead = x.shape[:-1]
    with torch.no_grad():
        q = m.q_proj(x).view(*lead, m.n_heads, m.head_dim)
        k = m.k_proj(x).view(*lead, m.n_kv, m.head_dim)
        if m.q_norm is not None:
            q, k = m.q_norm(q), m.k_norm(k)
    return q, k


def unrotated_context_keys(d, features: torch.Tensor) -> list[torch.Tensor]:
    """Per drafter layer, the context keys of target features `[B, T, F]` before RoPE
    (`k_norm(k_proj(hidden_norm(fc(f))))`) `[B, T, nkv, D]`: what a block drafter's layer
    turns a context row into, rotated at that row's position."""
    with torch.no_grad():
        ctx = d.project_context(features)
        out = []
        for layer in d.layers:
            a = layer.self_attn
            out.append(a.k_norm(a.k_proj(ctx).view(*ctx.shape[:-1], a.n_kv, a.head_dim)))
    return out
