"""Speculative-decoding verification: the rejection sampler (greedy and random requests).

Vocabulary (used the same way in `draftinfer`):

- A *round* verifies the `k_b >= 0` *draft tokens* `d_1..d_k` that request `b` proposed. The
  target scored every draft position, giving `p_i` (the target's distribution at draft
  position `i`, after temperature / top-k / top-p) and, for random drafters, `q_i` (the
  drafter's distribution that `d_i` was sampled from).
- *Accepted tokens*: the longest prefix `d_1..d_a` of drafts that pass the acceptance test.
- *Recovered token*: at the first rejection (row `a + 1`), one token sampled from the
  *residual* distribution `norm(max(p - q, 0))`; it replaces the rejected draft.
- *Bonus token*: when all `k` drafts are accepted, one extra token the caller sampled from
  the target's distribution at the position after the last draft (`bonus_token_ids[b]`).

Every round therefore emits `a + 1` tokens: `a` accepted drafts, then exactly one recovered or
bonus token. `num_accepted[b] = a`; the output row is padded with `-1` after the emitted tokens.

The p/q acceptance rule (random requests). Draft `d ~ q` is accepted with probability
`min(1, p(d) / q(d))`; on rejection the recovered token is drawn from `norm(max(p - q, 0))`.
The emitted token is then distributed exactly as `p` (Leviathan et al. 2023, Chen et al.
2023), whatever `q` is: that is what makes speculative sampling lossless. With a uniform
`u ~ U(0, 1]` the test is `u * q(d) <= p(d)`, which needs no division and is exact in fp32.

- One-hot `q` (`draft_probs is None`: the drafter chose `d` greedily, `q(d) = 1`): accept with
  probability `p(d)`; the residual `max(p - onehot(d), 0)` is `p` with `d` zeroed.
- `u` is never 0, so a draft with `p(d) = 0 < q(d)` is always rejected. A draft with `q(d) = 0`
  could not have been sampled from `q`; we accept it only if `p(d) > 0` (the limit of
  `min(1, p/q)`), so a token the target forbids is never emitted.
- The recovered token is sampled by the *exponential race*: with `E_v ~ Exp(1)` i.i.d.,
  `argmax_v r(v) / E_v` is distributed as `r / sum(r)` (since `E_v / r(v) ~ Exp(r(v))` and the
  smallest of independent exponentials is `v` with probability `r(v) / sum r`). Tokens with
  `r(v) = 0` score `-1` and can never win. If the residual is all zero (only when `p == q` up
  to rounding, where rejection is a probability-zero event) we race on `p` instead.

Greedy requests (`is_greedy[b]`): draft `d_i` is accepted while it equals `argmax p_i` (ties
go to the lowest token id); at the first mismatch the recovered token is that argmax.
Uniforms and noise of greedy requests are ignored.

Both implementations do the same fp32 operations (subtract, max, IEEE division, multiply,
compare) and the same lowest-index argmax, so `rejection_sample` and `rejection_sample_ref`
return bit-identical outputs for the same inputs (tests/kernels/test_rejection_sampler.py, T3).

Kernel layout: the vocabulary is split across programs, so that a batch of B requests fills
the GPU with B * S programs (one program per request reached only 22-37% of the memory
roofline at B = 64, V = 151936 on an H200: 64 programs for 132 SMs). Pass 1 runs program
(split s, request b) over token ids `[s * SPLIT_V, (s + 1) * SPLIT_V)`; pass 2 runs one
program per request. `splits` (see `rejection_sample`) overrides S.

- Pass 1, random request: the acceptance tests of all its drafts at once (draft i's test reads
  only `p_i(d_i)`, `q_i(d_i)`, `u_i`), which gives the first rejected row; then, at that row
  only, the split's residual race and its race on `p` (max score, lowest token id reaching
  it) into a workspace `[B, R, S]`. Greedy request: the split's argmax of `p_i` for every
  draft row i (acceptance of draft i needs the full-vocabulary argmax, so all rows are swept
  in parallel; pass 2 finds the first mismatch).
- Pass 2: per row, the max over the splits and, among the splits reaching it, the lowest
  token id. Each split holds the lowest id reaching its own max, so this is exactly the
  lowest-index argmax over the whole row: the result is the same for every split count
  (`splits=1` included) and bit-identical to the reference. Then the walk to the first
  rejection and the output row.
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

_MAX_BLOCK_V = 1024  # fp32 elements per V-chunk: 4 KiB per operand per loop trip
_PROGRAMS_PER_SM = 16  # pass-1 programs to aim for per SM: ~4 resident, several waves
_MIN_CHUNKS_PER_SPLIT = 4  # no split smaller than this many V-chunks (per-program overhead)
_MAX_SPLITS = 256  # bounds pass 2's [R, S] tile


if triton is not None:
    _NO_INDEX = tl.constexpr(2147483647)  # int32 max: "no token" in lowest-index reductions

    @triton.jit
    def _split_argmax(
        p_row,  # pointer to one row of target_probs [V]
        q_row,  # pointer to one row of draft_probs [V] (unused unless HAS_DRAFT_PROBS)
        noise_row,  # pointer to one row of recovery_noise [V] (unused when MODE == 0)
        draft,  # int64 scalar: the rejected draft token (one-hot q)
        lo,  # first token id of the split, a multiple of BLOCK_V
        hi,  # min(lo + split size, V)
        V,
        MODE: tl.constexpr,  # 0: p; 1: residual / noise; 2: p / noise
        HAS_DRAFT_PROBS: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """(max score, lowest token id reaching it) over ids [lo, hi), in V-chunks.

        Each lane keeps its own running best across chunks (strict '>' keeps the earliest
        chunk on ties), so the loop has no cross-lane reduction; one reduction at the end
        takes the max and, among lanes that reach it, the lowest token id. Split sizes are
        multiples of BLOCK_V, so a chunk never crosses the end of its split: `offs < V` is the
        only mask (and keeps loads vectorized).
        """
        lane_val = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        lane_idx = tl.zeros((BLOCK_V,), tl.int32)
        for off in range(lo, hi, BLOCK_V):
            offs = off + tl.arange(0, BLOCK_V)
            in_row = offs < V
            p = tl.load(p_row + offs, mask=in_row, other=0.0)
            if MODE == 0:
                score = p
            else:
                noise = tl.load(noise_row + offs, mask=in_row, other=1.0)
                if MODE == 1:
                    if HAS_DRAFT_PROBS:
                        q = tl.load(q_row + offs, mask=in_row, other=0.0)
                    else:
                        q = tl.where(offs == draft, 1.0, 0.0)
                    r = tl.maximum(p - q, 0.0)
                    # Where r = 0 the reference scores -1; here -2 where p = 0 too: no winner
                    # that is used changes (see the partials kernel), and the split's max
                    # then tells whether it holds any p > 0.
                    no_score = tl.where(p > 0.0, -1.0, -2.0)
                else:
                    r = p
                    no_score = -1.0
                # div_rn: IEEE round-to-nearest division, as torch does (plain `/` may be
                # approximate on GPU, which would break bit-exactness with the reference).
                score = tl.where(r > 0.0, tl.math.div_rn(r, noise), no_score)
            score = tl.where(in_row, score, float("-inf"))
            better = score > lane_val
            lane_idx = tl.where(better, offs, lane_idx)
            lane_val = tl.where(better, score, lane_val)
        best_val = tl.max(lane_val, axis=0)
        best_idx = tl.min(tl.where(lane_val == best_val, lane_idx, _NO_INDEX), axis=0)
        return best_val, best_idx

    @triton.jit
    def _rejection_partials_kernel(
        part_val_ptr,  # [B, R, S] fp32: best score of each split
        part_idx_ptr,  # [B, R, S] int32: the lowest token id of the split reaching it
        num_accepted_ptr,  # [B] int64: written here for random requests
        draft_ids_ptr,  # [N] int64
        cu_num_draft_ptr,  # [B + 1] int32 | int64
        draft_probs_ptr,  # [N, V] fp32 (a dummy pointer when not HAS_DRAFT_PROBS)
        target_probs_ptr,  # [N, V] fp32
        is_greedy_ptr,  # [B] bool
        uniforms_ptr,  # [N] fp32 in (0, 1]
        noise_ptr,  # [B, V] fp32, Exp(1)
        V,
        SPLIT_V,  # token ids per split, a multiple of BLOCK_V
        R,  # workspace rows per request: max(max_num_draft, 2)
        S,  # splits per request
        HAS_DRAFT_PROBS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,  # power of two >= max_num_draft
    ):
        """Pass 1, program (split s, request b): the V-sweeps, restricted to split s.

        Greedy request: partial argmax of p_i for every draft row i (row i of the workspace).
        Random request: the accepted prefix (a few scalar reads), then at the rejected row the
        partial residual race (workspace row 0) and the partial race on p (row 1, the
        fallback for an all-zero residual).
        """
        s = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        start = tl.load(cu_num_draft_ptr + b).to(tl.int64)
        n = tl.load(cu_num_draft_ptr + b + 1).to(tl.int64) - start
        greedy = tl.load(is_greedy_ptr + b) != 0
        lo = s * SPLIT_V
        hi = tl.minimum(lo + SPLIT_V, V)
        part = b * R * S + s  # workspace row r of this program: part + r * S
        if greedy:
            # Greedy draft i is accepted iff it is argmax p_i over the whole vocabulary: every
            # row's partial argmax now, in parallel; pass 2 finds the first mismatch. (Reads
            # rows past the first rejection, but at full bandwidth instead of one row after
            # another.) min(n, R) keeps a too-small max_num_draft inside the workspace.
            for i in range(0, tl.minimum(n, R)):
                p_row = target_probs_ptr + (start + i) * V
                val, idx = _split_argmax(
                    p_row, p_row, p_row, 0, lo, hi, V, 0, HAS_DRAFT_PROBS, BLOCK_V
                )
                tl.store(part_val_ptr + part + i * S, val)
                tl.store(part_idx_ptr + part + i * S, idx)
        else:
            # Draft i's test needs only p_i(d_i), q_i(d_i) and u_i: test every draft at once;
            # the first failure ends the accepted run.
            cols = tl.arange(0, BLOCK_K)
            valid = cols < n
            rows = start + cols
            drafts = tl.load(draft_ids_ptr + rows, mask=valid, other=0)
            p_d = tl.load(target_probs_ptr + rows * V + drafts, mask=valid, other=0.0)
            if HAS_DRAFT_PROBS:
                q_d = tl.load(draft_probs_ptr + rows * V + drafts, mask=valid, other=0.0)
            else:
                q_d = 1.0
            u = tl.load(uniforms_ptr + rows, mask=valid, other=1.0)
            accept = (p_d > 0.0) & (u * q_d <= p_d)
            num_acc = tl.min(tl.where(valid & ~accept, cols.to(tl.int64), n), axis=0)
            if s == 0:
                tl.store(num_accepted_ptr + b, num_acc)
            if num_acc < n:  # rejected: race for the recovered token at the rejected row
                row = start + num_acc
                d = tl.max(tl.where(cols == num_acc, drafts, 0), axis=0)  # no reload
                p_row = target_probs_ptr + row * V
                q_row = draft_probs_ptr + row * V
                noise_row = noise_ptr + b * V
                res_val, res_idx = _split_argmax(
                    p_row, q_row, noise_row, d, lo, hi, V, 1, HAS_DRAFT_PROBS, BLOCK_V
                )
                # Pass 2 uses the residual race if its max over the splits is > 0, else the
                # race on p; so only the sign of res_val <= -1 matters, and -2 means p = 0 on
                # the whole split. The race on p is swept only where the local residual is
                # empty and some p > 0 (rare); where p = 0 on the whole split (top-k / top-p
                # tails) every score is -1 and the lowest id is `lo`, no second read needed.
                p_val = tl.full((), -1.0, tl.float32)
                p_idx = lo
                if res_val == -1.0:
                    p_val, p_idx = _split_argmax(
                        p_row, q_row, noise_row, d, lo, hi, V, 2, HAS_DRAFT_PROBS, BLOCK_V
                    )
                tl.store(part_val_ptr + part, res_val)
                tl.store(part_idx_ptr + part, res_idx)
                tl.store(part_val_ptr + part + S, p_val)
                tl.store(part_idx_ptr + part + S, p_idx)

    @triton.jit
    def _rejection_finish_kernel(
        output_ptr,  # [B, OUT_WIDTH] int64
        num_accepted_ptr,  # [B] int64: pass 1 wrote random requests' counts
        draft_ids_ptr,  # [N] int64
        cu_num_draft_ptr,  # [B + 1] int32 | int64
        bonus_ptr,  # [B] int64
        is_greedy_ptr,  # [B] bool
        part_val_ptr,  # [B, R, S] fp32
        part_idx_ptr,  # [B, R, S] int32
        R,
        S,
        OUT_WIDTH,  # max_num_draft + 1
        BLOCK_K: tl.constexpr,  # power of two >= OUT_WIDTH
        BLOCK_S: tl.constexpr,  # power of two >= S
    ):
        """Pass 2, program b: reduce the splits, walk to the first rejection, write the row.

        Branch-free over greedy / random: both read a [rows, S] tile of partials (greedy: one
        row per draft; random: residual race and race on p, none when all were accepted)."""
        b = tl.program_id(0).to(tl.int64)
        start = tl.load(cu_num_draft_ptr + b).to(tl.int64)
        n = tl.load(cu_num_draft_ptr + b + 1).to(tl.int64) - start
        greedy = tl.load(is_greedy_ptr + b) != 0
        bonus = tl.load(bonus_ptr + b)
        random_acc = tl.load(num_accepted_ptr + b)  # meaningful for random requests only
        cols = tl.arange(0, BLOCK_K)
        splits = tl.arange(0, BLOCK_S)
        live = tl.where(greedy, tl.minimum(n, R), tl.where(random_acc < n, 2, 0))
        tile = (cols[:, None] < live) & (splits[None, :] < S)  # [BLOCK_K, BLOCK_S]
        offs = b * R * S + cols[:, None] * S + splits[None, :]
        vals = tl.load(part_val_ptr + offs, mask=tile, other=float("-inf"))
        idxs = tl.load(part_idx_ptr + offs, mask=tile, other=_NO_INDEX)
        # Each split holds its own lowest id at its max, so the lowest id over the splits
        # that reach the row's max is the whole row's lowest-index argmax.
        best = tl.max(vals, axis=1)  # [BLOCK_K]
        race = tl.min(tl.where(vals == best[:, None], idxs, _NO_INDEX), axis=1)  # [BLOCK_K]
        d = tl.load(draft_ids_ptr + start + cols, mask=cols < n, other=-1)

        # Greedy: accepted while the draft is argmax p_i; the argmax replaces the first miss.
        mismatch = (cols < live) & (race.to(tl.int64) != d)
        greedy_acc = tl.min(tl.where(mismatch, cols.to(tl.int64), n), axis=0)
        # Random: row 0 is the residual race, row 1 the race on p (for an empty residual).
        best_res = tl.max(tl.where(cols == 0, best, float("-inf")), axis=0)
        num_acc = tl.where(greedy, greedy_acc, random_acc)
        token_row = tl.where(greedy, greedy_acc, tl.where(best_res < 0.0, 1, 0))
        token = tl.max(tl.where(cols == token_row, race, -1), axis=0).to(tl.int64)
        token = tl.where(num_acc < n, token, bonus)  # all accepted: the bonus token
        tl.store(num_accepted_ptr + b, num_acc)
        # One store per row: accepted drafts, then the recovered / bonus token, then -1.
        out = tl.where(cols < num_acc, d, tl.where(cols == num_acc, token, -1))
        tl.store(output_ptr + b * OUT_WIDTH + cols, out, mask=cols < OUT_WIDTH)


def _launch_config(vocab_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of pass 1 for a vocabulary size (bench_rejection_sampler --tune)."""
    # Many programs share each SM (see `_split_layout`): 4 fp32 per thread and operand (one
    # 16-byte load each) at ~50 registers (sm_90) lets ~4 programs reside per SM and keeps
    # loads in flight while others reduce or wait on their first reads.
    block_v = min(triton.next_power_of_2(max(vocab_size, 1)), _MAX_BLOCK_V)
    num_warps = 8 if block_v >= 1024 else 4
    return block_v, num_warps


def _split_layout(
    vocab_size: int, batch: int, block_v: int, device: torch.device, splits: int | None
) -> tuple[int, int]:
    """(S splits per request, SPLIT_V token ids per split): split sizes are multiples of
    `block_v` and no split is empty, so S may come out below the `splits` asked for.

    Default on CUDA: enough pass-1 programs (B * S) for `_PROGRAMS_PER_SM` per SM, with at
    least `_MIN_CHUNKS_PER_SPLIT` chunks per split; 1 elsewhere. At most `_MAX_SPLITS`."""
    chunks = max(triton.cdiv(vocab_size, block_v), 1)
    if splits is None and device.type != "cuda":
        splits = 1  # the CPU interpreter runs programs one after another: fewest is fastest
    elif splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = triton.cdiv(_PROGRAMS_PER_SM * sms, max(batch, 1))
        splits = min(want, triton.cdiv(chunks, _MIN_CHUNKS_PER_SPLIT))
    elif splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    splits = max(1, min(splits, _MAX_SPLITS))
    split_v = triton.cdiv(chunks, splits) * block_v
    return triton.cdiv(vocab_size, split_v), split_v


def _check_inputs(
    draft_token_ids,
    cu_num_draft,
    draft_probs,
    target_probs,
    bonus_token_ids,
    is_greedy,
    uniforms,
    recovery_noise,
) -> tuple[int, int, int]:
    if target_probs.dim() != 2 or cu_num_draft.dim() != 1:
        raise ValueError("target_probs must be [N, V] and cu_num_draft [B + 1]")
    n, v = target_probs.shape
    b = cu_num_draft.shape[0] - 1
    if b < 0:
        raise ValueError("cu_num_draft must have B + 1 >= 1 entries")
    _check(draft_token_ids, "draft_token_ids", (torch.int64,), (n,))
    _check(cu_num_draft, "cu_num_draft", (torch.int32, torch.int64), (b + 1,))
    if draft_probs is not None:
        _check(draft_probs, "draft_probs", (torch.float32,), (n, v))
    _check(target_probs, "target_probs", (torch.float32,), (n, v))
    _check(bonus_token_ids, "bonus_token_ids", (torch.int64,), (b,))
    _check(is_greedy, "is_greedy", (torch.bool,), (b,))
    _check(uniforms, "uniforms", (torch.float32,), (n,))
    _check(recovery_noise, "recovery_noise", (torch.float32,), (b, v))
    tensors = [draft_token_ids, cu_num_draft, target_probs, bonus_token_ids, is_greedy]
    tensors += [uniforms, recovery_noise] + ([draft_probs] if draft_probs is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return b, n, v


def _resolve_max_num_draft(cu_num_draft: torch.Tensor, max_num_draft: int | None) -> int:
    if max_num_draft is not None:
        if max_num_draft < 0:
            raise ValueError(f"max_num_draft must be >= 0, got {max_num_draft}")
        return int(max_num_draft)
    if cu_num_draft.numel() <= 1:
        return 0
    return int((cu_num_draft[1:] - cu_num_draft[:-1]).max())  # host sync: pass it to avoid


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [N] int64, target-vocabulary ids
    cu_num_draft: torch.Tensor,  # [B + 1] int32 | int64, request b owns drafts cu[b]:cu[b+1]
    draft_probs: torch.Tensor | None,  # [N, V] fp32, or None for one-hot q
    target_probs: torch.Tensor,  # [N, V] fp32
    bonus_token_ids: torch.Tensor,  # [B] int64
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [N] fp32 in (0, 1]
    recovery_noise: torch.Tensor,  # [B, V] fp32, i.i.d. Exp(1)
    max_num_draft: int | None = None,
    *,
    block_v: int | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a ragged batch of drafts; see the module docstring for the rule.

    `N` may exceed `cu_num_draft[-1]` (a static-shape buffer): rows past it are never read.

    Returns `(output_token_ids [B, max_num_draft + 1] int64, num_accepted [B] int64)`: row `b`
    holds the accepted drafts, then one recovered or bonus token, then `-1`.

    `max_num_draft` must be >= every request's draft count; pass it to keep the call free of
    host syncs (None computes it from `cu_num_draft`). Draft ids must lie in `[0, V)`; neither
    is checked on the device (that would need a host sync). `block_v` (a power of two) sets the
    V-chunk of the kernel; `splits` the number of vocabulary splits per request (None: enough
    programs to fill the GPU; 1: one program per request; at most `ceil(V / block_v)`). Runs
    the Triton kernels where `draftkernels.runtime.use_triton` says so (CUDA, or CPU under
    `TRITON_INTERPRET=1`), else the torch reference. The result does not depend on
    `block_v` or `splits`.
    """
    b, n, v = _check_inputs(
        draft_token_ids,
        cu_num_draft,
        draft_probs,
        target_probs,
        bonus_token_ids,
        is_greedy,
        uniforms,
        recovery_noise,
    )
    if not use_triton(target_probs.device):
        return rejection_sample_ref(
            draft_token_ids,
            cu_num_draft,
            draft_probs,
            target_probs,
            bonus_token_ids,
            is_greedy,
            uniforms,
            recovery_noise,
            max_num_draft,
            block_v=block_v,
            splits=splits,
        )
    k = _resolve_max_num_draft(cu_num_draft, max_num_draft)
    device = target_probs.device
    output = torch.empty((b, k + 1), dtype=torch.int64, device=device)  # [B, K + 1]
    num_accepted = torch.empty((b,), dtype=torch.int64, device=device)  # [B]
    if b == 0:
        return output, num_accepted
    default_block_v, num_warps = _launch_config(v)
    block_v = default_block_v if block_v is None else block_v
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    num_splits, split_v = _split_layout(v, b, block_v, device, splits)
    r = max(k, 2)  # greedy: one workspace row per draft; random: residual race, race on p
    part_val = torch.empty((b, r, num_splits), dtype=torch.float32, device=device)
    part_idx = torch.empty((b, r, num_splits), dtype=torch.int32, device=device)
    block_k = triton.next_power_of_2(k + 1)
    _rejection_partials_kernel[(num_splits, b)](
        part_val,
        part_idx,
        num_accepted,
        draft_token_ids,
        cu_num_draft,
        draft_probs if draft_probs is not None else target_probs,
        target_probs,
        is_greedy,
        uniforms,
        recovery_noise,
        v,
        split_v,
        r,
        num_splits,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    _rejection_finish_kernel[(b,)](
        output,
        num_accepted,
        draft_token_ids,
        cu_num_draft,
        bonus_token_ids,
        is_greedy,
        part_val,
        part_idx,
        r,
        num_splits,
        k + 1,
        BLOCK_K=block_k,
        BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return output, num_accepted


def _lowest_argmax(score: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64; torch.argmax returns the first maximal index (documented)."""
    return torch.argmax(score, dim=-1)


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,  # [N] int64, target-vocabulary ids
    cu_num_draft: torch.Tensor,  # [B + 1] int32 | int64, request b owns drafts cu[b]:cu[b+1]
    draft_probs: torch.Tensor | None,  # [N, V] fp32, or None for one-hot q
    target_probs: torch.Tensor,  # [N, V] fp32
    bonus_token_ids: torch.Tensor,  # [B] int64
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [N] fp32 in (0, 1]
    recovery_noise: torch.Tensor,  # [B, V] fp32, i.i.d. Exp(1)
    max_num_draft: int | None = None,
    *,
    block_v: int | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `rejection_sample`: test oracle, CPU fallback and benchmark baseline.

    Vectorized over the batch with no host sync when `max_num_draft` is given. `block_v` and
    `splits` are accepted for signature parity and ignored (the reference sweeps whole rows).
    """
    b, n, v = _check_inputs(
        draft_token_ids,
        cu_num_draft,
        draft_probs,
        target_probs,
        bonus_token_ids,
        is_greedy,
        uniforms,
        recovery_noise,
    )
    k = _resolve_max_num_draft(cu_num_draft, max_num_draft)
    device = target_probs.device
    cu = cu_num_draft.to(torch.int64)
    starts, counts = cu[:-1], cu[1:] - cu[:-1]  # [B], [B]
    cols = torch.arange(k + 1, device=device)  # [K + 1]
    if n == 0:  # every request has zero drafts: emit the bonus token
        num_accepted = torch.zeros(b, dtype=torch.int64, device=device)
        output = torch.where(cols == 0, bonus_token_ids[:, None], -1)
        return output, num_accepted

    # Per-row acceptance, [N].
    # [N] request of each row = number of request ends <= row: a cumulative count of ends,
    # rather than searchsorted on a slice, which torch.compile 2.11 cannot lower on CUDA.
    ends = torch.zeros(n + 1, dtype=torch.int64, device=device)
    ends = ends.index_add(0, cu[1:], torch.ones_like(starts))
    req = ends.cumsum(0)[:n].clamp(max=max(b - 1, 0))  # rows past cu[-1] (unused) -> last
    greedy_row = is_greedy[req]
    d = draft_token_ids
    p_d = target_probs.gather(1, d[:, None])[:, 0]
    q_d = draft_probs.gather(1, d[:, None])[:, 0] if draft_probs is not None else 1.0
    target_argmax = _lowest_argmax(target_probs)  # [N]
    accept_random = (p_d > 0.0) & (uniforms * q_d <= p_d)
    accept = torch.where(greedy_row, target_argmax == d, accept_random)

    # Accepted prefix per request: [B, K] padded grid, cumulative product counts the run.
    grid = (starts[:, None] + cols[None, :k]).clamp(max=n - 1)  # [B, K]
    valid = cols[None, :k] < counts[:, None]
    accept_grid = accept[grid] & valid
    num_accepted = accept_grid.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    rejected = num_accepted < counts

    # Recovered token at the first rejected row (computed for every request, used where rejected).
    rej_row = (starts + num_accepted).clamp(max=n - 1)  # [B]
    p = target_probs[rej_row]  # [B, V]
    if draft_probs is not None:
        q = draft_probs[rej_row]
    else:
        q = (torch.arange(v, device=device)[None, :] == d[rej_row][:, None]).to(torch.float32)
    residual = torch.clamp_min(p - q, 0.0)
    score = torch.where(residual > 0.0, residual / recovery_noise, -1.0)
    best = score.max(dim=-1).values
    rec = _lowest_argmax(score)
    fallback = torch.where(p > 0.0, p / recovery_noise, -1.0)
    rec = torch.where(best < 0.0, _lowest_argmax(fallback), rec)
    rec = torch.where(is_greedy, target_argmax[rej_row], rec)
    token = torch.where(rejected, rec, bonus_token_ids)  # [B]

    drafts = torch.where(valid, d[grid], -1)  # [B, K]
    drafts = torch.cat([drafts, drafts.new_full((b, 1), -1)], dim=1)  # [B, K + 1]
    output = torch.where(
        cols[None, :] < num_accepted[:, None],
        drafts,
        torch.where(cols[None, :] == num_accepted[:, None], token[:, None], -1),
    )
    return output, num_accepted
