"""Building blocks shared by every drafter kind: RMSNorm, rotary embeddings, SwiGLU MLP and a
decoder layer whose attention *computation* is supplied by the caller.

Why a pluggable attention function: the same weights run under three different attention
patterns (training-time-test unrolling in `drafttrain`, a paged/static KV cache in the
runner, a from-scratch reference loop). The layer owns projections, RoPE and residuals; the
caller owns which keys a query may see (DESIGN section 2: "only the attention backend and
the input preparation differ").

Layout at the attention boundary: q `[B, T, n_heads, head_dim]`, k/v `[B, T, n_kv_heads,
head_dim]`, output `[B, T, n_heads, head_dim]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# attn_fn(layer_idx, q, k, v) -> o ; shapes in the module docstring.
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as HF Llama/Qwen do, so bf16 runs match the target's numerics.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` for default, linear and llama3 RoPE."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv.float()
    if rope_type == "linear":
        return (inv / float(scaling["factor"])).float()
    if rope_type == "llama3":
        # Llama-3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled).float()
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


def rope_params_from_hf(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from an HF config, transformers 4 (`rope_theta`/`rope_scaling`) or 5
    (`rope_parameters`)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return theta, scaling
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(getattr(config, "rope_theta", 10000.0)), scaling


class RotaryEmbedding(nn.Module):
    """cos/sin rows for integer positions. Positions are a tensor `[..., N]` (DESIGN 3.3)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [..., N] -> cos, sin [..., N, head_dim] (fp32)
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, T, heads, D]`, cos/sin `[B, T, D]` or `[T, D]` -> rotated x (dtype kept)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = x.float() * cos + _rotate_half(x.float()) * sin
    return out.to(x.dtype)


class SwiGLU(nn.Module):
    """Llama's gated MLP (`mlp_bias` optional, as in Llama configs)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Projections + RoPE; the score/softmax part is `attn_fn`."""

    def __init__(
        self,
        in_features: int,
        hidden: int,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        bias: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(in_features, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, n_kv * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_fn: AttnFn, layer_idx: int
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn_fn(layer_idx, q, k, v)  # [B, T, n_heads, head_dim]
        return self.o_proj(o.reshape(*lead, self.n_heads * self.head_dim))


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GQA: repeat kv heads `[..., n_kv, D]` -> `[..., n_heads, D]`."""
    n_kv = x.shape[-2]
    if n_kv == n_heads:
        return x
    return x.repeat_interleave(n_heads // n_kv, dim=-2)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain SDPA over `[B, T, heads, D]` tensors; `mask` is a bool `[B or 1, 1, Tq, Tk]` (True =
    may attend) or None for causal. The reference attention used by tests and simple paths."""
    n_heads = q.shape[-2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, expand_kv(k, n_heads), expand_kv(v, n_heads)))
    if mask is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return o.transpose(1, 2)
