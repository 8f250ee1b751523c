"""Building blocks shared by every drafter kind and the native targets: RMSNorm, SwiGLU MLP
and an attention block whose score/softmax *computation* is supplied by the caller (rotary
embeddings live in `draftinfer.models.rope`).

Why a pluggable attention function: the same weights run under three different attention
patterns (training-time-test unrolling in `drafttrain`, a paged/static KV cache in the
runner, a from-scratch reference loop). The layer owns projections, RoPE and residuals; the
caller owns which keys a query may see (DESIGN section 2: "only the attention backend and
the input preparation differ").

Layout at the attention boundary: q `[B, T, n_heads, head_dim]`, k/v `[B, T, n_kv_heads,
head_dim]`, output `[B, T, n_heads, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from draftinfer.models.rope import apply_rope

# attn_fn(layer_idx, q, k, v) -> o ; shapes in the module docstring.
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """`x / rms(x) * weight` with fp32 statistics, as HF Llama/Qwen compute it (so bf16 runs
    match the target's numerics): the normalised `x` is cast back to its dtype, then scaled.

    `scale_in_fp32` (gpt-oss, HF `GptOssRMSNorm`): the weight multiplies the fp32 normalised
    `x` in fp32 and the product is cast back ("main diff with Llama"); HF keeps those weights
    in fp32 (`_keep_in_fp32_modules`), the same values as ours when the checkpoint's are bf16.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, scale_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.scale_in_fp32 = scale_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_fp32:
            return (self.weight.float() * x).to(dtype)
        return self.weight * x.to(dtype)


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
        *,
        o_bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(in_features, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, n_kv * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=o_bias)
        # Qwen3: RMSNorm over head_dim on q and k, before RoPE.
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_fn: AttnFn, layer_idx: int
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        q, k, v = self.project(x)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv, self.head_dim)
        v = v.view(*lead, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn_fn(layer_idx, q, k, v)  # [B, T, n_heads, head_dim]
        return self.o_proj(o.reshape(*lead, self.n_heads * self.head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[..., n_heads * d]`, k and v `[..., n_kv * d]` (a serving transform fuses them)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v only `[..., n_kv * d]` (keys/values of rows that ask no query)."""
        return self.k_proj(x), self.v_proj(x)


class DecoderLayer(nn.Module):
    """A pre-norm Llama-family decoder layer (Llama, Qwen2, Qwen3) with pluggable attention.

    Parameter names equal Hugging Face's and the native targets' (`self_attn.q_proj`, ...,
    `mlp.gate_proj`, `input_layernorm`, `post_attention_layernorm`), so a target's layer loads
    into it by name. `arch` carries `hidden_size`, `intermediate_size`, `num_attention_heads`,
    `num_key_value_heads`, `head_dim`, `rms_norm_eps`, `qkv_bias`, `o_bias`, `mlp_bias`,
    `qk_norm`.
    """

    def __init__(self, arch):
        super().__init__()
        c = arch
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            c.hidden_size,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.qkv_bias,
            o_bias=c.o_bias,
            qk_norm=c.qk_norm,
            eps=c.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, c.mlp_bias)

    def forward(self, x, cos, sin, attn_fn: AttnFn, idx: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_fn, idx)
        return x + self.mlp(self.post_attention_layernorm(x))


def head_logits(head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`head(x)` for `x [..., H]` as one 2-D GEMM over the flattened rows. `F.linear` on a
    strided 3-D slice (a block's slots `normed[:, 1:]`) runs one GEMM per leading index,
    each re-reading the weight: at a 128256-row head, batch 8, 7.3x slower on an H200
    (`python -m draftbench.head_gemm`: 1.95 ms vs 0.29 ms)."""
    return head(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


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
