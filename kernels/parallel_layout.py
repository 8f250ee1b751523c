"""Parallel drafting (ptd: P-EAGLE / PTD): the drafter input of one parallel drafter forward.

Vocabulary (used the same way in `draftinfer`):

- A *round* verifies a request's drafts with the target, commits the accepted drafts plus one
  recovered or *bonus* token (`docs/architecture.md`, glossary), then drafts again. The last
  committed token is the *pending* token: not yet in the target KV, the first slot of the next
  verify forward.
- *First-pass rows* of request `b`: the drafter rows the last commit made final. Row `j`
  consumes `(token_ids[b, j], target feature f_j)` at position `pos_start[b] + j`
  (convention 1: row `i` consumes `t_{i+1}` at the target position of token `i`). The first
  `n_valid[b]` rows are *committed* (the accepted drafts plus the recovered or bonus token of
  the last round, or a whole prompt after prefill); the *pending row* is the last of them, at
  `p_last = pos_start + n_valid - 1`. Rows `j >= n_valid` held drafts the target *rejected*.
- A *mask slot* `m = 1..K-1` carries the mask token id and `mask_hidden` (no target feature)
  at position `p_last + m` on every axis (DESIGN 3.9). One forward yields `K` drafts: draft 1
  from the pending row, draft `m + 1` from mask slot `m`.
- *Padding*: a slot with position -1, token id 0, no KV write and no feature. Rejected rows
  become padding, and so does every mask slot past the draft cap.

Output layout, per request, `W = Q + K - 1` columns (DESIGN 3.9):

    | valid rows 0..n_valid-1 (pending row last) | K-1 mask slots | rejected-as-padding |

    column c              out_ids          out_pos          feat_src
    c < n_valid           token_ids[b, c]  pos_start + c    c   (first-pass row index)
    c = n_valid - 1 + m   mask_token_id    p_last + m       -1  (mask_hidden), m < num_drafts
    otherwise             0                -1               -2  (padding)

`sample_idx[b, m]` (m = 0..K-1) is the column whose drafter output yields draft `m + 1`:
`n_valid - 1 + m` (the pending row for m = 0, mask slot m after it) while `m < num_drafts`,
else -1. Every `sample_idx >= 0` points at a live (non-padding) column.

Draft cap. The pending row sits at `p_last` and consumes the pending token, which sits at
`p_last + 1`; the committed length is therefore `L = p_last + 2` (tokens at 0..L-1). The next
round verifies `[pending, d_1..d_n]` at positions `L-1 .. L-1+n` and emits up to `n + 1` tokens
(`a` accepted drafts plus one recovered or bonus token), leaving up to `L + n + 1` committed
tokens, which must not exceed `max_model_len`:

    n <= max_model_len - L - 1 = max_model_len - p_last - 3
    num_drafts = clamp(min(K, max_drafts, max_model_len - p_last - 3), 0, K)

So `p_last = max_model_len - 2` (`L = max_model_len`, the sequence is full) and
`p_last = max_model_len - 3` both give 0 drafts. A drafted mask slot `m < num_drafts` sits at
`p_last + m <= max_model_len - 4`, so the cap alone keeps every KV write below
`max_model_len`; as a second guard, any slot whose position would be `>= max_model_len`
(a committed row included, which only a caller past the limit can produce) is padding.
Positions never wrap to 0: a slot past the limit is -1, never `pos % max_model_len`.

Buffer sizing. Request `b` has at most `Q_b + K - 1` live slots (`num_drafts <= K` gives at
most `K - 1` mask slots), so a flat ragged buffer for the whole batch needs
`sum(Q_b) + B * (K - 1)` slots, bounded by `max_tokens + max_reqs * K` (DESIGN 3.9) when
`sum(Q_b) <= max_tokens` and `B <= max_reqs`. The outputs here are padded `[B, Q + K - 1]`;
`feat_src` indexes the request's own first-pass rows (flat row = `cu_q[b] + feat_src`).

Positions are the 1-D KV / sequence positions; an M-RoPE caller gathers the 3-D positions of
valid rows through `feat_src` and puts mask slot `m` at `(p_last + m)` on all three axes
(convention 3). Both implementations do integer arithmetic only, so `parallel_layout` and
`parallel_layout_ref` agree exactly (tests/kernels/test_parallel_layout.py, S6).
"""

from __future__ import annotations

import torch
from draftkernels.runtime import check_tensor as _check
from draftkernels.runtime import triton_available, use_triton

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - triton ships with torch on every supported platform
    triton = None

PAD_TOKEN_ID = 0  # token id of a padding slot (any fixed id: padding writes no KV)
FEAT_MASK = -1  # feat_src of a mask slot: consumes mask_hidden
FEAT_PAD = -2  # feat_src of a padding slot: consumes nothing
_MAX_BLOCK_W = 1024  # columns per loop trip (a long prefill row takes several trips)


if triton is not None:

    @triton.jit
    def _parallel_layout_kernel(
        out_ids_ptr,  # [B, W] int64
        out_pos_ptr,  # [B, W] int64
        feat_src_ptr,  # [B, W] int64
        sample_idx_ptr,  # [B, K] int64
        num_drafts_ptr,  # [B] int64
        token_ids_ptr,  # [B, Q] int64
        n_valid_ptr,  # [B] int32 | int64
        pos_start_ptr,  # [B] int64
        max_drafts_ptr,  # [B] int64
        Q,
        W,  # Q + K - 1
        mask_token_id,
        max_model_len,
        K: tl.constexpr,
        BLOCK_W: tl.constexpr,
        BLOCK_K: tl.constexpr,  # power of two >= K
    ):
        b = tl.program_id(0).to(tl.int64)
        n_valid = tl.load(n_valid_ptr + b).to(tl.int64)
        pos_start = tl.load(pos_start_ptr + b).to(tl.int64)
        max_drafts = tl.load(max_drafts_ptr + b).to(tl.int64)
        p_last = pos_start + n_valid - 1
        # Draft cap (module docstring): the next round must leave <= max_model_len tokens.
        num_drafts = max_model_len - p_last - 3
        num_drafts = tl.where(max_drafts < num_drafts, max_drafts, num_drafts)
        num_drafts = tl.where(num_drafts < K, num_drafts, K)
        num_drafts = tl.where(num_drafts > 0, num_drafts, 0)

        for off in range(0, W, BLOCK_W):
            cols = off + tl.arange(0, BLOCK_W).to(tl.int64)
            in_row = cols < W
            is_valid = cols < n_valid
            m = cols - n_valid + 1  # mask slot number of column c (meaningful where c >= n_valid)
            is_mask = (cols >= n_valid) & (m < num_drafts)
            pos = tl.where(is_valid, pos_start + cols, p_last + m)
            # A slot at or past max_model_len writes no KV: padding, never a wrapped position.
            live = (is_valid | is_mask) & (pos < max_model_len)
            tok = tl.load(
                token_ids_ptr + b * Q + cols, mask=is_valid & (cols < Q) & in_row, other=0
            )
            ids = tl.where(is_valid, tok, tl.zeros_like(tok) + mask_token_id)
            # literals, not the module constants: a @triton.jit body reads only constexpr globals
            ids = tl.where(live, ids, 0)  # PAD_TOKEN_ID
            feat = tl.where(is_valid, cols, -1)  # FEAT_MASK
            feat = tl.where(live, feat, -2)  # FEAT_PAD
            pos = tl.where(live, pos, -1)
            row = b * W + cols
            tl.store(out_ids_ptr + row, ids, mask=in_row)
            tl.store(out_pos_ptr + row, pos, mask=in_row)
            tl.store(feat_src_ptr + row, feat, mask=in_row)

        ms = tl.arange(0, BLOCK_K).to(tl.int64)
        sample = tl.where(ms < num_drafts, n_valid - 1 + ms, -1)
        tl.store(sample_idx_ptr + b * K + ms, sample, mask=ms < K)
        tl.store(num_drafts_ptr + b, num_drafts)


def _check_inputs(
    token_ids, n_valid, pos_start, max_drafts, k, mask_token_id, max_model_len
) -> tuple[int, int]:
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2:
        raise ValueError("token_ids must be a [B, Q] tensor")
    b, q = token_ids.shape
    if q < 1:
        raise ValueError("token_ids must have Q >= 1 columns (every request has a pending row)")
    _check(token_ids, "token_ids", (torch.int64,), (b, q))
    _check(n_valid, "n_valid", (torch.int32, torch.int64), (b,))
    _check(pos_start, "pos_start", (torch.int64,), (b,))
    _check(max_drafts, "max_drafts", (torch.int64,), (b,))
    for name, v in (("k", k), ("mask_token_id", mask_token_id), ("max_model_len", max_model_len)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be a Python int, got {type(v).__name__}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if mask_token_id < 0:
        raise ValueError(f"mask_token_id must be >= 0, got {mask_token_id}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    devices = {t.device for t in (token_ids, n_valid, pos_start, max_drafts)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return b, q


def parallel_layout(
    token_ids: torch.Tensor,  # [B, Q] int64, first-pass token ids (rows >= n_valid: rejected)
    n_valid: torch.Tensor,  # [B] int32 | int64, committed rows per request, 1 <= n_valid <= Q
    pos_start: torch.Tensor,  # [B] int64, position of first-pass row 0
    max_drafts: torch.Tensor,  # [B] int64, the caller's per-request draft cap (any int)
    k: int,  # K >= 1 drafts per parallel forward
    mask_token_id: int,
    max_model_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expand first-pass rows into the input of one parallel drafter forward (module docstring).

    Returns, with `W = Q + K - 1`:
      - `out_ids [B, W] int64`: token ids (mask token at mask slots, 0 at padding);
      - `out_pos [B, W] int64`: positions, -1 at padding (no KV write);
      - `feat_src [B, W] int64`: `j >= 0` consumes first-pass row j's target feature, -1 a
        mask slot (consumes `mask_hidden`), -2 padding;
      - `sample_idx [B, K] int64`: the column whose output yields draft `m + 1`, -1 where
        draft `m + 1` is not drafted;
      - `num_drafts [B] int64`: `clamp(min(K, max_drafts, max_model_len - p_last - 3), 0, K)`.

    No host sync. `1 <= n_valid <= Q` is the caller's contract and is not checked on the device
    (that would need a sync); out of range, the outputs are unspecified but memory stays in
    bounds. Runs the Triton kernel where `draftkernels.runtime.use_triton` says so (CUDA, or
    CPU under `TRITON_INTERPRET=1`), else `parallel_layout_ref`.
    """
    b, q = _check_inputs(token_ids, n_valid, pos_start, max_drafts, k, mask_token_id, max_model_len)
    device = token_ids.device
    if not use_triton(device):
        return parallel_layout_ref(
            token_ids, n_valid, pos_start, max_drafts, k, mask_token_id, max_model_len
        )
    w = q + k - 1
    out_ids = torch.empty((b, w), dtype=torch.int64, device=device)  # [B, W]
    out_pos = torch.empty((b, w), dtype=torch.int64, device=device)  # [B, W]
    feat_src = torch.empty((b, w), dtype=torch.int64, device=device)  # [B, W]
    sample_idx = torch.empty((b, k), dtype=torch.int64, device=device)  # [B, K]
    num_drafts = torch.empty((b,), dtype=torch.int64, device=device)  # [B]
    if b == 0:
        return out_ids, out_pos, feat_src, sample_idx, num_drafts
    _parallel_layout_kernel[(b,)](
        out_ids,
        out_pos,
        feat_src,
        sample_idx,
        num_drafts,
        token_ids,
        n_valid,
        pos_start,
        max_drafts,
        q,
        w,
        mask_token_id,
        max_model_len,
        K=k,
        BLOCK_W=min(triton.next_power_of_2(w), _MAX_BLOCK_W),
        BLOCK_K=triton.next_power_of_2(k),
        num_warps=4,
    )
    return out_ids, out_pos, feat_src, sample_idx, num_drafts


def parallel_layout_ref(
    token_ids: torch.Tensor,  # [B, Q] int64, first-pass token ids (rows >= n_valid: rejected)
    n_valid: torch.Tensor,  # [B] int32 | int64, committed rows per request, 1 <= n_valid <= Q
    pos_start: torch.Tensor,  # [B] int64, position of first-pass row 0
    max_drafts: torch.Tensor,  # [B] int64, the caller's per-request draft cap (any int)
    k: int,  # K >= 1 drafts per parallel forward
    mask_token_id: int,
    max_model_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch `parallel_layout`: test oracle, CPU fallback and benchmark baseline.

    Vectorized over the batch, no host sync, no data-dependent shapes (so
    `torch.compile(parallel_layout_ref)` traces it whole).
    """
    b, q = _check_inputs(token_ids, n_valid, pos_start, max_drafts, k, mask_token_id, max_model_len)
    device = token_ids.device
    w = q + k - 1
    nv = n_valid.to(torch.int64)[:, None]  # [B, 1]
    ps = pos_start[:, None]  # [B, 1]
    p_last = ps + nv - 1  # [B, 1]
    cap = torch.clamp(max_model_len - p_last - 3, max=k)
    num_drafts = torch.minimum(cap, max_drafts[:, None]).clamp(min=0, max=k)  # [B, 1]

    cols = torch.arange(w, device=device, dtype=torch.int64)[None, :]  # [1, W]
    is_valid = cols < nv  # [B, W]
    m = cols - nv + 1  # mask slot number where cols >= n_valid
    is_mask = ~is_valid & (m < num_drafts)
    pos = torch.where(is_valid, ps + cols, p_last + m)
    live = (is_valid | is_mask) & (pos < max_model_len)
    tok = token_ids.gather(1, cols.clamp(max=q - 1).expand(b, w))  # [B, W]
    out_ids = torch.where(is_valid, tok, mask_token_id)
    out_ids = torch.where(live, out_ids, PAD_TOKEN_ID)
    out_pos = torch.where(live, pos, -1)
    feat_src = torch.where(live, torch.where(is_valid, cols, FEAT_MASK), FEAT_PAD)

    ms = torch.arange(k, device=device, dtype=torch.int64)[None, :]  # [1, K]
    sample_idx = torch.where(ms < num_drafts, nv - 1 + ms, -1)  # [B, K]
    return out_ids, out_pos, feat_src, sample_idx, num_drafts[:, 0]
