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
return bit-identical outputs for the same inputs (tests/test_rejection_sampler.py, T3).
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

_MAX_BLOCK_V = 8192  # fp32 elements per V-chunk: 32 KiB per operand per loop trip


if triton is not None:

    @triton.jit
    def _row_argmax(
        p_row,  # pointer to one row of target_probs [V]
        q_row,  # pointer to one row of draft_probs [V] (unused unless HAS_DRAFT_PROBS)
        noise_row,  # pointer to one row of recovery_noise [V]
        draft,  # int64 scalar: the rejected draft token (one-hot q)
        V,
        MODE: tl.constexpr,  # 0: p; 1: residual / noise; 2: p / noise
        HAS_DRAFT_PROBS: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """(max score, lowest index reaching it) over the row, in V-chunks of BLOCK_V.

        Each lane keeps its own running best across chunks (strict '>' keeps the earliest
        chunk on ties), so the loop has no cross-lane reduction; one reduction at the end
        takes the max and, among lanes that reach it, the lowest token id.
        """
        lane_val = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        lane_idx = tl.zeros((BLOCK_V,), tl.int32)
        for off in range(0, V, BLOCK_V):
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
                else:
                    r = p
                # div_rn: IEEE round-to-nearest division, as torch does (plain `/` may be
                # approximate on GPU, which would break bit-exactness with the reference).
                score = tl.where(r > 0.0, tl.math.div_rn(r, noise), -1.0)
            score = tl.where(in_row, score, float("-inf"))
            better = score > lane_val
            lane_idx = tl.where(better, offs, lane_idx)
            lane_val = tl.where(better, score, lane_val)
        best_val = tl.max(lane_val, axis=0)
        best_idx = tl.min(tl.where(lane_val == best_val, lane_idx, 2147483647), axis=0)
        return best_val, best_idx.to(tl.int64)

    @triton.jit
    def _rejection_sample_kernel(
        output_ptr,  # [B, OUT_WIDTH] int64
        num_accepted_ptr,  # [B] int64
        draft_ids_ptr,  # [N] int64
        cu_num_draft_ptr,  # [B + 1] int32 | int64
        draft_probs_ptr,  # [N, V] fp32 (a dummy pointer when not HAS_DRAFT_PROBS)
        target_probs_ptr,  # [N, V] fp32
        bonus_ptr,  # [B] int64
        is_greedy_ptr,  # [B] bool
        uniforms_ptr,  # [N] fp32 in (0, 1]
        noise_ptr,  # [B, V] fp32, Exp(1)
        V,
        OUT_WIDTH,  # max_num_draft + 1
        HAS_DRAFT_PROBS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,  # power of two >= OUT_WIDTH
    ):
        b = tl.program_id(0).to(tl.int64)
        start = tl.load(cu_num_draft_ptr + b).to(tl.int64)
        n = tl.load(cu_num_draft_ptr + b + 1).to(tl.int64) - start
        greedy = tl.load(is_greedy_ptr + b) != 0
        token = tl.load(bonus_ptr + b)  # stays the bonus token unless a draft is rejected
        noise_row = noise_ptr + b * V

        # Walk the drafts until the first rejection.
        num_acc = tl.full((), 0, tl.int64)
        going = n > 0
        while going:
            row = start + num_acc
            d = tl.load(draft_ids_ptr + row)
            p_row = target_probs_ptr + row * V
            if greedy:
                _, am = _row_argmax(p_row, p_row, noise_row, d, V, 0, HAS_DRAFT_PROBS, BLOCK_V)
                accept = am == d
            else:
                am = d
                p_d = tl.load(p_row + d)
                if HAS_DRAFT_PROBS:
                    q_d = tl.load(draft_probs_ptr + row * V + d)
                else:
                    q_d = 1.0
                u = tl.load(uniforms_ptr + row)
                accept = (p_d > 0.0) & (u * q_d <= p_d)
            # greedy recovered token = argmax p at the rejected row
            token = tl.where(accept, token, am)
            num_acc += accept.to(tl.int64)
            going = accept & (num_acc < n)

        # Random request, rejected: sample the recovered token from the residual.
        if (num_acc < n) & (greedy == 0):
            row = start + num_acc
            d = tl.load(draft_ids_ptr + row)
            p_row = target_probs_ptr + row * V
            q_row = draft_probs_ptr + row * V
            best, rec = _row_argmax(p_row, q_row, noise_row, d, V, 1, HAS_DRAFT_PROBS, BLOCK_V)
            if best < 0.0:  # residual all zero: race on p itself
                best, rec = _row_argmax(p_row, q_row, noise_row, d, V, 2, HAS_DRAFT_PROBS, BLOCK_V)
            token = rec

        # One store per row: accepted drafts, then the recovered / bonus token, then -1.
        cols = tl.arange(0, BLOCK_K)
        drafts = tl.load(draft_ids_ptr + start + cols, mask=cols < num_acc, other=-1)
        out = tl.where(cols < num_acc, drafts, tl.where(cols == num_acc, token, -1))
        tl.store(output_ptr + b * OUT_WIDTH + cols, out, mask=cols < OUT_WIDTH)
        tl.store(num_accepted_ptr + b, num_acc)


def _launch_config(vocab_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a vocabulary size (scripts/bench_rejection_sampler.py --tune)."""
    # H200, V = 151936 (--tune): 16 warps x 8192-wide chunks keep the most loads in flight in
    # the single program that sweeps a row; this loop is latency-bound, not bandwidth-bound.
    block_v = min(triton.next_power_of_2(max(vocab_size, 1)), _MAX_BLOCK_V)
    num_warps = 16 if block_v >= 4096 else 8 if block_v >= 2048 else 4
    return block_v, num_warps


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a ragged batch of drafts; see the module docstring for the rule.

    `N` may exceed `cu_num_draft[-1]` (a static-shape buffer): rows past it are never read.

    Returns `(output_token_ids [B, max_num_draft + 1] int64, num_accepted [B] int64)`: row `b`
    holds the accepted drafts, then one recovered or bonus token, then `-1`.

    `max_num_draft` must be >= every request's draft count; pass it to keep the call free of
    host syncs (None computes it from `cu_num_draft`). Draft ids must lie in `[0, V)`; neither
    is checked on the device (that would need a host sync). `block_v` (a power of two) sets the
    V-chunk of the kernel. Runs the Triton kernel where `draftkernels.runtime.use_triton`
    says so (CUDA, or CPU under `TRITON_INTERPRET=1`), else the torch reference.
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
    _rejection_sample_kernel[(b,)](
        output,
        num_accepted,
        draft_token_ids,
        cu_num_draft,
        draft_probs if draft_probs is not None else target_probs,
        target_probs,
        bonus_token_ids,
        is_greedy,
        uniforms,
        recovery_noise,
        v,
        k + 1,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_V=block_v,
        BLOCK_K=triton.next_power_of_2(k + 1),
        num_warps=num_warps,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `rejection_sample`: test oracle, CPU fallback and benchmark baseline.

    Vectorized over the batch with no host sync when `max_num_draft` is given. `block_v` is
    accepted for signature parity and ignored (the reference sweeps whole rows).
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
