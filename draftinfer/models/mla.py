"""Multi-head latent attention (MLA; DeepSeek-V2/V3, HF `DeepseekV3Attention`) over a latent
KV cache: the attention a family's `decoder_layer` builds where the dense block has
`CachedAttention` (same call, same cache addressing, its own cache).

    attn = LatentAttention(H, nh, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, softmax_scale=s)

Projections, with HF's names (`self_attn.*`), per token `x [H]`:
- query: `q = q_b_proj(q_a_layernorm(q_a_proj(x)))` (or `q_proj(x)` without `q_lora_rank`),
  `[nh, dn + dr]`, split into `q_nope [nh, dn]` and `q_rot [nh, dr]`;
- the latent: `kv_a_proj_with_mqa(x)` = `[c | k_rot]`, `c = kv_a_layernorm(.)[:R]` (R =
  `kv_lora_rank`) and `k_rot [dr]`, one rotary key shared by every head;
- keys and values per head from the latent: `kv_b_proj(c)` = `[k_nope [dn] | v [dv]]` per head,
  the key `[k_nope | k_rot]`;
- RoPE on `q_rot` and `k_rot` only: interleaved pairs (`rope_interleave`, DeepSeek's layout;
  `rope.apply_rope_interleaved`) or NeoX halves; the rotary's `head_dim` is `dr`;
- the softmax scale `(dn + dr)^-0.5`, times `mscale^2` under YaRN (`softmax_scale`, computed by
  the family from its rope config).

The cache holds the latent, never expanded heads: `latent_cache [max_batch, max_seq_len + 1,
R + dr]`, `[c | rotated k_rot]` per token (576 values per token per layer at DeepSeek-V3's
sizes, against `2 * nh * 192 = 49152` for expanded keys and values; the FlashMLA layout).
Addressing is `draftinfer.models.kv_cache`'s: slot `(b, t)` writes at `[rows[b],
write_pos[b, t]]` (padding slots in the scratch column), the mask `[B, 1, T, L]` says what it
reads; written before read, so a verify pass's rejected rows are overwritten by the next
pass before anything reads them, exactly as in a K/V cache (no rollback step).

Two computations of the same attention (`path`: None = chosen from the shapes, no sync):
- `expanded` (prefill, more than `ABSORB_MAX_TOKENS` query slots): `kv_b_proj` over the cached
  latent gives every head's keys and values, then SDPA (the `L x nh x (dn + dv)` expansion is
  paid once for many queries);
- `absorbed` (decode, verify, drafting): `W_uk` (the key half of `kv_b_proj`) is folded into
  the query, `q_lat = q_nope W_uk [nh, R]`, so scores are `[q_lat | q_rot] . [c | k_rot]`
  against the latent itself (one shared "KV head" of width R + dr, values `c`), and `W_uv`
  (the value half) is applied to the `[nh, R]` output before `o_proj`: the cache is read once,
  never expanded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftinfer.models.kv_cache import read_rows
from draftinfer.models.layers import RMSNorm
from draftinfer.models.rope import apply_rope, apply_rope_interleaved

# Query slots per forward up to which `LatentAttention` runs absorbed (decode, verify and
# drafting rounds); longer forwards (prefill chunks) expand the latent.
ABSORB_MAX_TOKENS = 16
PATHS = ("absorbed", "expanded")
# The epsilon of the latent norms (`q_a_layernorm`, `kv_a_layernorm`): transformers builds them
# with its RMSNorm's default, 1e-6, whatever the config's `rms_norm_eps` (HF
# `DeepseekV3Attention`, `Glm4MoeLiteAttention`; DeepSeek's reference code does the same; vLLM
# passes `rms_norm_eps`). Equal for DeepSeek-V3 (1e-6); GLM-4.7-Flash's config says 1e-5, which
# moves its logits by ~1e-4 in fp32 when used here.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """HF `yarn_apply_mscale`: `qk_head_dim^-0.5`, times `mscale^2` where the rope is scaled and
    names `mscale_all_dim`, `mscale = 0.1 * mscale_all_dim * ln(factor) + 1` (1 for factor <=
    1): 1.3689^2 at DeepSeek-V3's factor 40."""
    scale = qk_head_dim**-0.5
    scaling = scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        factor = float(scaling["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


class LatentAttention(nn.Module):
    """MLA with a latent cache (module docstring). Called as `CachedAttention` is:
    `(x [B, T, H], cos, sin [B, T, dr] fp32, rows [B], write_pos [B, T], mask [B, 1, T, L],
    attn_len) -> [B, T, H]`."""

    window = None  # no sliding window (`NativeCausalLM.layer_masks` reads it)

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        rope_interleave: bool = True,
        bias: bool = False,
        eps: float = LATENT_NORM_EPS,
    ):
        super().__init__()
        self.n_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.dn, self.dr, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale, self.rope_interleave = softmax_scale, rope_interleave
        self.path: str | None = None
        self.q_lora = q_lora_rank is not None
        dq = qk_nope_head_dim + qk_rope_head_dim
        if not self.q_lora:
            self.q_proj = nn.Linear(hidden, num_heads * dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden, bias=bias)
        self.latent_cache: torch.Tensor | None
        self.register_buffer("latent_cache", None, persistent=False)

    @property
    def cache_width(self) -> int:
        """Values cached per token: `kv_lora_rank + qk_rope_head_dim` (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.dr

    def allocate_cache(
        self, max_batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """`latent_cache [max_batch, max_seq_len + 1, R + dr]` (the `+ 1`: the scratch column)."""
        shape = (max_batch, max_seq_len + 1, self.cache_width)
        self.latent_cache = torch.zeros(shape, dtype=dtype, device=device)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:
            return apply_rope_interleaved(x, cos, sin)
        return apply_rope(x, cos, sin)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope `[B, T, nh, dn]`, q_rot `[B, T, nh, dr]` unrotated, latent `[B, T, R + dr]`
        with `c` normed and `k_rot` unrotated)."""
        B, T, _ = x.shape
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_rot = q.view(B, T, self.n_heads, self.dn + self.dr).split([self.dn, self.dr], -1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.dr], -1)
        return q_nope, q_rot, torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, T, dr] fp32
        sin: torch.Tensor,  # [B, T, dr] fp32
        rows: torch.Tensor,  # [B] cache row of each batch row
        write_pos: torch.Tensor,  # [B, T] cache index of each slot (scratch column for padding)
        mask: torch.Tensor,  # [B, 1, T, L] bool, True = may attend
        attn_len: int,  # L: number of cache indices read
    ) -> torch.Tensor:
        B, T, _ = x.shape
        R = self.kv_lora_rank
        q_nope, q_rot, latent = self.project(x)
        q_rot = self.rope(q_rot, cos, sin)
        k_rot = self.rope(latent[..., None, R:], cos, sin)[..., 0, :]  # one head, [B, T, dr]
        latent = torch.cat([latent[..., :R], k_rot], dim=-1)  # [B, T, R + dr]
        # Write first, then read: a slot sees its own latent and those of earlier slots.
        cache = self.latent_cache
        cache.index_put_((rows[:, None].expand(B, T), write_pos), latent.to(cache.dtype))
        lat = read_rows(cache, rows, attn_len).to(x.dtype)  # [B, L, R + dr]
        path = self.path or ("absorbed" if T <= ABSORB_MAX_TOKENS else "expanded")
        attend = self.attend_absorbed if path == "absorbed" else self.attend_expanded
        o = attend(q_nope, q_rot, lat, mask)  # [B, T, nh, dv]
        return self.o_proj(o.reshape(B, T, self.n_heads * self.dv))

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk `[nh, dn, R]`, W_uv `[nh, dv, R]`): `kv_b_proj`'s key and value halves."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.dn + self.dv, self.kv_lora_rank)
        return w[:, : self.dn], w[:, self.dn :]

    def attend_expanded(
        self,
        q_nope: torch.Tensor,  # [B, T, nh, dn]
        q_rot: torch.Tensor,  # [B, T, nh, dr] rotated
        lat: torch.Tensor,  # [B, L, R + dr] the cached latent
        mask: torch.Tensor,  # [B, 1, T, L]
    ) -> torch.Tensor:
        """Every head's keys and values expanded from the latent (`kv_b_proj`), then SDPA
        -> `[B, T, nh, dv]`."""
        B, L, _ = lat.shape
        nh, R = self.n_heads, self.kv_lora_rank
        kv = self.kv_b_proj(lat[..., :R]).view(B, L, nh, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, lat[:, :, None, R:].expand(B, L, nh, self.dr)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
        )  # [B, nh, T, dv]
        return o.transpose(1, 2)

    def attend_absorbed(
        self,
        q_nope: torch.Tensor,  # [B, T, nh, dn]
        q_rot: torch.Tensor,  # [B, T, nh, dr] rotated
        lat: torch.Tensor,  # [B, L, R + dr]
        mask: torch.Tensor,  # [B, 1, T, L]
    ) -> torch.Tensor:
        """`W_uk` absorbed into the query, attention over the latent as one shared KV head of
        width `R + dr` (values: `c`), `W_uv` applied to the `[nh, R]` output -> `[B, T, nh,
        dv]`. Written as two batched products and a softmax, not SDPA: no flash kernel takes a
        576-wide head, and PyTorch's memory-efficient kernel tiles the `T * nh` query rows, so
        at batch 1 one program walked every key: 110 us a layer against 25 us for this, compiled,
        on an H200 at GLM-4.7-Flash's sizes (`python -m draftbench.mla_attention`;
        `docs/results.md`). Scores and softmax in fp32, the probabilities cast to the latent's
        dtype for the second product (as flash attention does).
        """
        B, T, nh, _ = q_nope.shape
        R = self.kv_lora_rank
        w_uk, w_uv = self._kv_b()
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)  # [B, T, nh, R]
        q = torch.cat([q_lat, q_rot], dim=-1).reshape(B, T * nh, R + self.dr)
        # Scores in fp32 from fp32 operands (a bf16 product would round them before the softmax).
        s = torch.bmm(q.float(), lat.float().transpose(1, 2)).view(B, T, nh, -1) * self.scale
        s = s.masked_fill(~mask[:, 0, :, None, :], float("-inf"))  # [B, T, nh, L]
        p = torch.softmax(s, dim=-1).to(lat.dtype).view(B, T * nh, -1)
        o_lat = torch.bmm(p, lat[..., :R])  # [B, T * nh, R]
        return torch.einsum("bthr,hvr->bthv", o_lat.view(B, T, nh, R), w_uv)
