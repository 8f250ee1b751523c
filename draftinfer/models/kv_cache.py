"""One KV-cache design for targets and drafters: static (preallocated), addressed by
(cache row, cache index), with a scratch column for padding slots (gpt-fast style).

Per layer, `k` and `v` are `[max_batch, max_len + 1, n_kv, head_dim]`. Slot `(b, t)` writes
its key/value at `[rows[b], cache_pos[b, t]]`; a padding slot (`cache_pos = -1`) writes into
the extra last column, which no query ever reads (reads stop at `attn_len <= max_len`). So a
padded batch needs no boolean indexing and no host sync, and with a fixed `attn_len` every
forward has static shapes.

Visibility: a query at cache index `p` reads cache indices `0..p` of its row (padding slots
read index 0 only, so no softmax row is empty). Why no rollback is ever needed: a round writes
indices from the committed length on, in order, and each layer writes before it reads; a query
at `p` never looks past `p`. An entry a rejected draft left past the committed length is
therefore overwritten before any query can see it, or never read at all. Conventions 6 and 7
follow from the same rule: the mask is rebuilt from `cache_pos` at every call, so no
sequence-length state can go stale between draft steps.

Attention backends (`ATTENTION`, chosen per target layer from outside the model code by
`draftinfer.models.transforms.use_attention`): `split_kv` (the default, `DEFAULT_ATTENTION`)
runs a forward of at most 64 query rows per KV head (decode, verify, drafting) on CUDA through
the split-KV Triton kernel `draftkernels.decode_attention`, and everything else as `sdpa`;
`sdpa` runs `F.scaled_dot_product_attention` over the rows' cache prefix; `maths_decode` writes a compiled
one-token step (T == 1) as plain tensor maths that inductor fuses into its own reduction
kernels (how gpt-fast's decode step is compiled), and is `sdpa` everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import draftkernels.decode_attention as split_kv
import torch
import torch.nn.functional as F

from draftinfer.conventions.slots import Slots, max_live_position


def write_index(cache_pos: torch.Tensor, scratch: int) -> torch.Tensor:
    """Cache index each slot writes: its `cache_pos`, or the scratch column for padding."""
    return torch.where(cache_pos >= 0, cache_pos, torch.full_like(cache_pos, scratch))


def visibility_mask(cache_pos: torch.Tensor, attn_len: int, group: int) -> torch.Tensor:
    """Bool `[B, 1, T * group, attn_len]`: query slot `(b, t)` (repeated for the `group` query
    heads of each KV head, see `cached_attention`) may read cache index `j` iff
    `j <= cache_pos[b, t]`; padding slots read index 0 only."""
    B, T = cache_pos.shape
    keys = torch.arange(attn_len, device=cache_pos.device)
    mask = keys <= cache_pos.clamp(min=0)[..., None]  # [B, T, L]
    return mask[:, None, :, None, :].expand(B, 1, T, group, attn_len).reshape(B, 1, T * group, -1)


def resolve_attn_len(slots: Slots, max_len: int) -> int:
    """`slots.attn_len`, or max live cache index + 1 found with one host sync (and checked)."""
    if slots.attn_len is not None:
        if not 1 <= slots.attn_len <= max_len:
            raise ValueError(f"attn_len={slots.attn_len} must be in 1..{max_len}")
        return slots.attn_len
    top = max_live_position(slots.cache_pos)
    if top >= max_len:
        raise ValueError(
            f"cache index {top} is out of range: the KV cache holds {max_len} positions "
            f"(0..{max_len - 1}); positions never wrap"
        )
    return max(top + 1, 1)


def cached_attention(
    q: torch.Tensor,  # [B, T, nh, D]
    k: torch.Tensor,  # [B, T, nkv, D]
    v: torch.Tensor,  # [B, T, nkv, D]
    k_cache: torch.Tensor,  # [max_batch, max_len + 1, nkv, D]
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [B]
    write_pos: torch.Tensor,  # [B, T] from `write_index`
    mask: torch.Tensor,  # [B, 1, T * g, L] from `visibility_mask`
    attn_len: int,  # L
) -> torch.Tensor:
    """Write this forward's K/V, then attend over the row's first `attn_len` cache indices.
    -> `[B, T, nh, D]`.

    GQA without copying K/V per query head: head h uses KV head h // g (HF's repeat_kv order),
    so the group is folded into the query-length axis: `[B, nkv, T * g, D]`.
    """
    B, T, nh, d = q.shape
    nkv = k.shape[2]
    write_cache(k, v, k_cache, v_cache, rows, write_pos)
    kc = read_rows(k_cache, rows, attn_len).transpose(1, 2).to(q.dtype)  # [B, nkv, L, D]
    vc = read_rows(v_cache, rows, attn_len).transpose(1, 2).to(q.dtype)
    g = nh // nkv
    qf = q.view(B, T, nkv, g, d).permute(0, 2, 1, 3, 4).reshape(B, nkv, T * g, d)
    o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=mask)  # [B, nkv, T * g, D]
    return o.view(B, nkv, T, g, d).permute(0, 2, 1, 3, 4).reshape(B, T, nh, d)


def write_cache(
    k: torch.Tensor,  # [B, T, nkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [max_batch, max_len + 1, nkv, D]
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # [B]
    write_pos: torch.Tensor,  # [B, T] from `write_index`
) -> None:
    """Store slot `(b, t)`'s key/value at `[rows[b], write_pos[b, t]]`."""
    B, T = write_pos.shape
    write_rows = rows[:, None].expand(B, T)
    k_cache.index_put_((write_rows, write_pos), k.to(k_cache.dtype))
    v_cache.index_put_((write_rows, write_pos), v.to(v_cache.dtype))


def read_rows(cache: torch.Tensor, rows: torch.Tensor, attn_len: int) -> torch.Tensor:
    """Cache indices `0..attn_len-1` of each row in `rows` -> `[B, attn_len, nkv, D]`.

    A cache of a single row is read as a view: its only valid `rows` is `[0]`, so the
    per-layer copy of the K/V prefix a gather makes (which an SDPA kernel, an extern call,
    needs materialised) is skipped. Several rows are gathered (inductor folds the gather into
    the loads of an attention it generates itself, `maths_decode`)."""
    if cache.shape[0] == 1 and rows.shape[0] == 1:
        return cache[:, :attn_len]
    return cache[rows, :attn_len]


def decode_attention(
    q: torch.Tensor,  # [B, 1, nh, D]
    kc: torch.Tensor,  # [B, L, nkv, D] from `read_rows`
    vc: torch.Tensor,  # [B, L, nkv, D]
    mask: torch.Tensor,  # [B, 1, g, L] bool from `visibility_mask` (T == 1)
) -> torch.Tensor:
    """Attention of one query per row as plain tensor maths, fp32 -> `[B, 1, nh, D]`.

    Scores are a broadcast multiply summed over D and the output a weighted sum over L, so
    inductor generates both as reductions of its own (fused with the cache reads, the
    mask and the casts; no extern kernel, no K/V copy), spread over `B * nh * L` and
    `B * nh * D` outputs; a memory-efficient SDPA kernel runs only `B * nkv` programs for a
    one-token step. Query head h uses KV head h // g (HF's repeat_kv order). In eager it
    materialises `[B, nh, L, D]` products: meant for compiled steps (`maths_decode`)."""
    B, _, nh, d = q.shape
    nkv = kc.shape[2]
    g = nh // nkv
    qf = q.reshape(B, nkv, g, 1, d).float() * d**-0.5
    kf = kc.permute(0, 2, 1, 3)[:, :, None].float()  # [B, nkv, 1, L, D]
    vf = vc.permute(0, 2, 1, 3)[:, :, None].float()
    s = (qf * kf).sum(-1)  # [B, nkv, g, L]
    s = s.masked_fill(~mask, float("-inf"))  # mask [B, 1, g, L] broadcasts over kv heads
    p = torch.softmax(s, dim=-1)
    o = (p[..., None] * vf).sum(-2)  # [B, nkv, g, D]
    return o.reshape(B, 1, nh, d).to(q.dtype)


def cached_attention_maths_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    write_pos: torch.Tensor,
    mask: torch.Tensor,
    attn_len: int,
) -> torch.Tensor:
    """`cached_attention` (same arguments) whose one-token step (T == 1), when traced by
    `torch.compile`, is `decode_attention`: the attention inductor generates itself. Eager
    calls and T > 1 (prefill, verify) run `cached_attention`'s SDPA kernel."""
    if q.shape[1] != 1 or not torch.compiler.is_compiling():
        return cached_attention(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len)
    write_cache(k, v, k_cache, v_cache, rows, write_pos)
    kc = read_rows(k_cache, rows, attn_len)
    vc = read_rows(v_cache, rows, attn_len)
    return decode_attention(q, kc, vc, mask)


def cached_attention_split_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    write_pos: torch.Tensor,
    mask: torch.Tensor,
    attn_len: int,
) -> torch.Tensor:
    """`cached_attention` (same arguments) whose attention of a few query slots per row
    (decode, verify, drafting: `T * g <= 64`) on CUDA is `draftkernels.decode_attention`, a
    split-KV Triton kernel reading the cache in place; prefill chunks and the CPU run SDPA."""
    if not (q.is_cuda and split_kv.TRITON and split_kv.fits(q, k_cache)):
        return cached_attention(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len)
    write_cache(k, v, k_cache, v_cache, rows, write_pos)
    return split_kv.decode_attention(q, k_cache, v_cache, rows, mask, attn_len)


# attention(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len) -> o [B, T, nh, D]
AttentionFn = Callable[..., torch.Tensor]
ATTENTION: dict[str, AttentionFn] = {
    "split_kv": cached_attention_split_kv,
    "sdpa": cached_attention,
    "maths_decode": cached_attention_maths_decode,
}
# What targets and drafters attend with unless `transforms.use_attention` says otherwise.
DEFAULT_ATTENTION = "split_kv"


def default_attention(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len) -> torch.Tensor:
    """`cached_attention`'s signature through the `DEFAULT_ATTENTION` backend (looked up per
    call): the one place targets' layers, `bind_cache` and the block drafter name it."""
    return ATTENTION[DEFAULT_ATTENTION](q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len)


def bind_cache(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slots: Slots):
    """An `attn_fn(layer, q, k, v)` over per-layer caches `[max_batch, max_len + 1, nkv, D]`
    for one forward over `slots`: the write index and the mask are built once and shared by
    every layer."""
    max_len = k_cache[0].shape[1] - 1
    attn_len = resolve_attn_len(slots, max_len)
    write_pos = write_index(slots.cache_pos, max_len)
    masks: dict[int, torch.Tensor] = {}

    def attn_fn(layer: int, q, k, v):
        g = q.shape[2] // k.shape[2]
        if g not in masks:
            masks[g] = visibility_mask(slots.cache_pos, attn_len, g)
        return default_attention(
            q, k, v, k_cache[layer], v_cache[layer], slots.rows, write_pos, masks[g], attn_len
        )

    return attn_fn


class KVCache:
    """Per-layer K/V for a stack of attention layers (a drafter's, or anything outside an
    `nn.Module`); the native targets keep the same tensors as module buffers."""

    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        max_len: int,
        n_kv: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ):
        shape = (max_batch, max_len + 1, n_kv, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len, self.n_kv = max_len, n_kv

    def bind(self, slots: Slots):
        """An `attn_fn(layer, q, k, v)` for one forward over `slots`."""
        return bind_cache(self.k, self.v, slots)

    def snapshot(self, row: int, n: int) -> list[torch.Tensor]:
        """K and V of every layer at cache indices `0..n-1` of `row` (tests: KV refresh)."""
        return [t[row, :n].clone() for pair in zip(self.k, self.v) for t in pair]
