"""One KV-cache design for targets and drafters: static (preallocated), addressed by
(cache row, cache index), with a scratch column for padding slots (gpt-fast style).

Per layer, `k` and `v` are `[max_batch, max_len + 1, n_kv, head_dim]`. Slot `(b, t)` writes
its key/value at `[rows[b], cache_pos[b, t]]`; a padding slot (`cache_pos = -1`) writes into
the extra last column, which no query ever reads (reads stop at `attn_len <= max_len`). So a
padded batch needs no boolean indexing and no host sync, and with a fixed `attn_len` every
forward has static shapes.

Visibility: a query at cache index `p` reads cache indices `0..p` of its row (padding slots
read index 0 only, so no softmax row is empty); in a sliding-window layer of `w` keys only
`p - w < j <= p` (HF `kv_idx > q_idx - sliding_window`), a mask like any other. The cache of a
window layer stays full-length (a ring buffer is later work), so it trivially keeps the
`window + K + 1` rows of history DESIGN 14 asks for. Why no rollback is ever needed: a round writes
indices from the committed length on, in order, and each layer writes before it reads; a query
at `p` never looks past `p`. An entry a rejected draft left past the committed length is
therefore overwritten before any query can see it, or never read at all. Conventions 6 and 7
follow from the same rule: the mask is rebuilt from `cache_pos` at every call, so no
sequence-length state can go stale between draft steps.

Attention backends (`ATTENTION`, chosen per target layer from outside the model code by
`draftinfer.models.transforms.use_attention`): `split_kv` (the default, `DEFAULT_ATTENTION`)
runs a forward of at most 128 query rows per KV head (decode, verify, drafting; in launches of
64) on CUDA through the split-KV Triton kernel `draftkernels.decode_attention`, and everything else as `sdpa`;
`sdpa` runs `F.scaled_dot_product_attention` over the rows' cache prefix; `maths_decode` writes a compiled
one-token step (T == 1) as plain tensor maths that inductor fuses into its own reduction
kernels (how gpt-fast's decode step is compiled), and is `sdpa` everywhere else.

Attention sinks (gpt-oss): every backend takes an optional `sinks [nh]` fp32, one learned logit
per query head that joins the softmax and carries no value: `softmax([scores, sink])` with the
sink's column dropped before the product with V (HF `eager_attention_forward` of gpt-oss).
`sdpa` adds it exactly as an extra zero key/value column whose additive float-mask entry is the
head's sink; `maths_decode` as a column of its explicit softmax; `split_kv`'s kernel as one more
split when it merges its splits.
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


def visibility_mask(
    cache_pos: torch.Tensor, attn_len: int, group: int, window: int | None = None
) -> torch.Tensor:
    """Bool `[B, 1, T * group, attn_len]`: query slot `(b, t)` (repeated for the `group` query
    heads of each KV head, see `cached_attention`) may read cache index `j` iff
    `j <= cache_pos[b, t]`, and with a sliding `window` of keys also `j > cache_pos[b, t] -
    window`; padding slots read index 0 only."""
    B, T = cache_pos.shape
    keys = torch.arange(attn_len, device=cache_pos.device)
    pos = cache_pos.clamp(min=0)[..., None]  # [B, T, 1]
    mask = keys <= pos  # [B, T, L]
    if window is not None:
        mask = mask & (keys > pos - window)
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
    sinks: torch.Tensor | None = None,  # [nh] fp32: per-head sink logits
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
    if sinks is not None:
        kc, vc, mask = sink_column(kc, vc, mask, sinks, T)
    o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=mask)  # [B, nkv, T * g, D]
    return o.view(B, nkv, T, g, d).permute(0, 2, 1, 3, 4).reshape(B, T, nh, d)


def sink_column(
    kc: torch.Tensor,  # [B, nkv, L, D]
    vc: torch.Tensor,  # [B, nkv, L, D]
    mask: torch.Tensor,  # [B, 1, T * g, L] bool
    sinks: torch.Tensor,  # [nh] fp32
    T: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks for SDPA, exactly: a zero key and a zero value appended at column L, and
    an additive float mask `[B, nkv, T * g, L + 1]` (0 where the bool mask allows, -inf where
    not, the head's sink logit at column L). The sink column's score is `q . 0 * scale + sink
    = sink`, so the softmax runs over `[scores, sink]`, and its zero value adds nothing to the
    output. Row `t * g + i` of KV head `n` is query head `n * g + i` (the folded layout)."""
    B, nkv, L, d = kc.shape
    g = sinks.shape[0] // nkv
    zero = kc.new_zeros(B, nkv, 1, d)
    kc, vc = torch.cat([kc, zero], dim=2), torch.cat([vc, zero], dim=2)
    dtype = kc.dtype
    zero_s = torch.zeros((), dtype=dtype, device=kc.device)
    add = torch.where(mask, zero_s, torch.full_like(zero_s, float("-inf")))  # [B, 1, T * g, L]
    sink = sinks.to(dtype).view(1, nkv, 1, g, 1).expand(B, nkv, T, g, 1).reshape(B, nkv, T * g, 1)
    add = torch.cat([add.expand(B, nkv, T * g, L), sink], dim=-1)
    return kc, vc, add


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
    sinks: torch.Tensor | None = None,  # [nh] fp32 sink logits
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
    if sinks is not None:  # the sink joins the softmax as one more column, then is dropped
        sink = sinks.float().view(1, nkv, g, 1).expand(B, nkv, g, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`cached_attention` (same arguments) whose one-token step (T == 1), when traced by
    `torch.compile`, is `decode_attention`: the attention inductor generates itself. Eager
    calls and T > 1 (prefill, verify) run `cached_attention`'s SDPA kernel."""
    if q.shape[1] != 1 or not torch.compiler.is_compiling():
        return cached_attention(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len, sinks)
    write_cache(k, v, k_cache, v_cache, rows, write_pos)
    kc = read_rows(k_cache, rows, attn_len)
    vc = read_rows(v_cache, rows, attn_len)
    return decode_attention(q, kc, vc, mask, sinks)


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`cached_attention` (same arguments) whose attention of a few query slots per row
    (decode, verify, drafting: `T * g <= 128`) on CUDA is `draftkernels.decode_attention`, a
    split-KV Triton kernel reading the cache in place; prefill chunks and the CPU run SDPA.
    A sliding window is only a mask, which the kernel reads like any other; sinks (gpt-oss)
    join the kernel's merge of its key splits."""
    if not (q.is_cuda and split_kv.TRITON and split_kv.fits(q, k_cache)):
        return cached_attention(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len, sinks)
    write_cache(k, v, k_cache, v_cache, rows, write_pos)
    return split_kv.decode_attention(q, k_cache, v_cache, rows, mask, attn_len, sinks)


# attention(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len, sinks=None)
#   -> o [B, T, nh, D]
AttentionFn = Callable[..., torch.Tensor]
ATTENTION: dict[str, AttentionFn] = {
    "split_kv": cached_attention_split_kv,
    "sdpa": cached_attention,
    "maths_decode": cached_attention_maths_decode,
}
# What targets and drafters attend with unless `transforms.use_attention` says otherwise.
DEFAULT_ATTENTION = "split_kv"


def default_attention(
    q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len, sinks=None
) -> torch.Tensor:
    """`cached_attention`'s signature through the `DEFAULT_ATTENTION` backend (looked up per
    call): the one place targets' layers, `bind_cache` and the block drafter name it."""
    backend = ATTENTION[DEFAULT_ATTENTION]
    if sinks is None:  # a backend from outside may not take sinks: only pass them when set
        return backend(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len)
    return backend(q, k, v, k_cache, v_cache, rows, write_pos, mask, attn_len, sinks)


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
