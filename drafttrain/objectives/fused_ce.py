"""Linear + soft cross-entropy that never keeps the logits: the drafter's head and its loss
in one autograd function, chunked over rows.

For rows `n` with normed hidden `h[n] [H]`, head weight `W [V, H]`, soft labels
`p[row[n]] [V]` (a row of a target-distribution table, `drafttrain.frozen.head`), the
target's top-1 `top1[row[n]]` and a group `group[n]` (-1: not counted):

    z[n]     = h[n] @ W^T                               (the drafter's logits, never stored)
    ce[n]    = -sum_v p[n, v] * log_softmax(z[n])[v] = lse(z[n]) * sum_v p[n, v] - p[n] . z[n]
    loss[g]  = sum_{n: group[n] = g} ce[n]             (differentiable, fp32)
    hits[g]  = #{n in g: argmax z[n] == top1[row[n]]}
    count[g] = #{n in g}

Forward computes `z` one chunk of rows at a time (the matmul in the autocast dtype, or the
inputs' dtype without autocast; softmax statistics in fp32). The loss is a sum of per-group
sums, so its gradient with respect to `z[n]` is the incoming gradient of `n`'s group times
`dce/dz = softmax(z) * sum(p) - p`, which the chunk already holds. While gradients are wanted,
forward therefore applies it at once: `grad_h = dz @ W` per chunk and `grad_W = sum_chunks
dz^T @ h` (fp32 accumulation), both unscaled, and backward only multiplies them by the
incoming gradients (Liger's fused linear cross-entropy does the same). Two matmuls per chunk
with a frozen head, three with a trained one, instead of the four of a recompute. The one
case that recomputes in backward is a trained head with several groups (ptd's depths): its
`grad_W` would need one `[V, H]` accumulator per group, so forward keeps `lse [N]` and
backward recomputes each chunk's `z`. Peak extra memory is a few `[chunk, V]` fp32 buffers
plus the unscaled gradients (`[N, H]`, and `[V, H]` in the weight's dtype) instead of `[N, V]`
logits plus their fp32 log-softmax per draft position. The per-chunk elementwise math is one
compiled kernel on CUDA (eager elsewhere). The label table is read through `row`, so an
objective that scores rows against shifted targets (TTT step k: row i against target row
i+1+k) passes an index, never a shifted copy of the table.

`linear_soft_ce_ref` is the plain formula (the test oracle).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftinfer.decoding.compiled import cuda_compiled_call
from drafttrain.objectives.loss_fns import SOFT_CE, RowLoss

# Logit values per chunk: rows = CHUNK_ELEMENTS // V (2048 rows of a 32k draft vocabulary).
CHUNK_ELEMENTS = 1 << 26
# Problems up to this many logits (and one chunk) run the plain formula (`linear_soft_ce`):
# the CPU recipes (ptd at most 8 x (256 + 1024) x 2048 = 21M), never a real-shape batch
# (2048 x 32000 is already 65M).
PLAIN_ELEMENTS = 1 << 25


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _group_sums(values: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """values `[c]`, group `[c]` (-1 = none) -> per-group sums `[groups]` (values' dtype)."""
    onehot = group[:, None] == torch.arange(groups, device=group.device)[None]  # [c, G]
    # Rows of no group are zeroed first: a non-finite value there must not leak in as 0 * inf.
    return torch.where(group >= 0, values, 0) @ onehot.to(values.dtype)


def _forward_chunk(z, probs, rows, top1, loss):
    """z `[c, V]` logits; the chunk's labels are `probs[rows]` (read inside: on CUDA the
    gather fuses into the kernel, no `[c, V]` copy) -> (lse `[c]`, the loss `[c]` fp32 (soft
    cross-entropy `-sum p * log_softmax(z)`, or the `RowLoss` given), hit `[c]` fp32: argmax
    z == `top1[rows]`)."""
    zf, pf = z.float(), probs[rows].float()
    lse = torch.logsumexp(zf, dim=-1)
    return lse, loss.value(zf, lse, pf), (z.argmax(-1) == top1[rows]).float()


def _forward_grad_chunk(z, probs, rows, top1, s, loss):
    """`_forward_chunk` plus the logit gradient scaled by `s` (`_backward_chunk`; s = 1 on
    counted rows, or their row weight), exactly 0 on rows with s = 0. One compiled kernel on
    CUDA: the two calls inline into it."""
    lse, ce, hit = _forward_chunk(z, probs, rows, top1, loss)
    return lse, ce, hit, _backward_chunk(z, lse, probs, rows, s, loss)


def _backward_chunk(z, lse, probs, rows, s, loss):
    """d(sum_n s_n loss_n) / dz = s * `loss.grad` (for soft cross-entropy `softmax(z) *
    sum(p) - p`) with p = `probs[rows]`, `[c, V]` in z's dtype; exactly 0 on rows with s = 0
    (uncounted rows, whatever their logits)."""
    pf = probs[rows].float()
    dz = loss.grad(z.float(), lse, pf) * s[:, None]
    return torch.where(s[:, None] != 0, dz, 0.0).to(z.dtype)


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`acc += a @ b` in place, with `acc` fp32 and `a`, `b` possibly bf16: on CUDA one GEMM
    accumulating into fp32 in place (`addmm(acc, a, b, out_dtype=, out=acc)`: no bf16
    rounding of each chunk's product, no separate add pass, and no copy of `acc` into a new
    output, which the out-of-place `addmm(..., out_dtype=)` made: at the 8B draft head, a
    500 MB fp32 copy per chunk, ~0.35 ms each on an H100); elsewhere, or in a torch without
    it, `acc += a @ b`."""
    if a.dtype != acc.dtype and a.is_cuda and _ADDMM_OUT_DTYPE:
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return acc.add_(a @ b)


_ADDMM_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, probs, rows, top1, group, groups, chunk, dtype, grads, loss, rw
    ):
        N = hidden.shape[0]
        dev = hidden.device
        total = torch.zeros(groups, dtype=torch.float32, device=dev)
        hits = torch.zeros(groups, dtype=torch.float32, device=dev)
        count = torch.zeros(groups, dtype=torch.float32, device=dev)
        need_h, need_w = ctx.needs_input_grad[0] and grads, ctx.needs_input_grad[1] and grads
        # Gradients in the forward pass (module docstring) unless the weight's would need one
        # accumulator per group: then backward recomputes the logits.
        early = (need_h or need_w) and (groups == 1 or not need_w)
        lse = None if early else torch.empty(N, dtype=torch.float32, device=dev)
        grad_h = torch.empty_like(hidden) if early and need_h else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=dev) if early and need_w else None
        )
        w = weight.to(dtype)
        with torch.autocast(dev.type, enabled=False):
            for lo in range(0, N, chunk):
                hi = min(N, lo + chunk)
                h = hidden[lo:hi].to(dtype)
                z = F.linear(h, w)  # [c, V]
                r, g = rows[lo:hi], group[lo:hi]
                s = (g >= 0).float() * (1.0 if rw is None else rw[lo:hi])  # [c] row scale
                if early:
                    _, ce, hit, dz = cuda_compiled_call(
                        _forward_grad_chunk, z, probs, r, top1, s, loss
                    )
                    if need_h:
                        grad_h[lo:hi] = dz @ w
                    if need_w:
                        grad_w = _accumulate_mm(grad_w, dz.t(), h)
                else:
                    lse[lo:hi], ce, hit = cuda_compiled_call(
                        _forward_chunk, z, probs, r, top1, loss
                    )
                total += _group_sums(ce if rw is None else ce * rw[lo:hi], g, groups)
                hits += _group_sums(hit, g, groups)
                count += _group_sums(torch.ones_like(hit), g, groups)
        ctx.early, ctx.chunk, ctx.dtype, ctx.loss = early, chunk, dtype, loss
        if early:
            # Unscaled gradients (d loss[g] / d input); backward only scales them. Only what
            # backward reads is kept: not the hidden states, labels or logit statistics.
            ctx.save_for_backward(
                grad_h, None if grad_w is None else grad_w.to(weight.dtype), group
            )
        else:
            ctx.save_for_backward(hidden, weight, probs, rows, group, lse, rw)
        ctx.mark_non_differentiable(hits, count)
        return total, hits, count

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits, _grad_count):
        # Incoming gradient of each row's group (0 for rows no group counts).
        scale_of = torch.cat([grad_loss.float(), grad_loss.new_zeros(1, dtype=torch.float32)])

        def scale(g: torch.Tensor) -> torch.Tensor:
            return scale_of[torch.where(g >= 0, g, grad_loss.shape[0])]  # [c]

        if ctx.early:
            grad_h, grad_w, group = ctx.saved_tensors
            if grad_h is not None:
                grad_h = (grad_h * scale(group)[:, None]).to(grad_h.dtype)
            if grad_w is not None:  # one group: every counted row has the same scale
                grad_w = (grad_w * grad_loss[0].float()).to(grad_w.dtype)
            return (grad_h, grad_w) + (None,) * 10
        hidden, weight, probs, rows, group, lse, rw = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N = hidden.shape[0]
        dev = hidden.device
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
        w = weight.to(dtype)
        with torch.autocast(dev.type, enabled=False):
            for lo in range(0, N, chunk):
                hi = min(N, lo + chunk)
                h = hidden[lo:hi].to(dtype)
                s = scale(group[lo:hi]) * (1.0 if rw is None else rw[lo:hi])
                z = F.linear(h, w)  # recomputed, [c, V]
                dz = cuda_compiled_call(
                    _backward_chunk, z, lse[lo:hi], probs, rows[lo:hi], s, ctx.loss
                )
                if need_h:
                    grad_h[lo:hi] = dz @ w
                if need_w:
                    grad_w = _accumulate_mm(grad_w, dz.t(), h)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype)) + (None,) * 10


def linear_soft_ce(
    hidden: torch.Tensor,  # [N, H] normed hidden states (the head's input)
    weight: torch.Tensor,  # [V, H] head weight
    probs: torch.Tensor,  # [M, V] soft labels (rows of a target distribution)
    rows: torch.Tensor,  # [N] int64: the label row of each hidden row
    top1: torch.Tensor,  # [M] int64: the target's argmax of each label row
    group: torch.Tensor,  # [N] int64: the loss group of each row, -1 = not counted
    groups: int = 1,
    chunk_elements: int = CHUNK_ELEMENTS,
    loss: RowLoss = SOFT_CE,
    row_weight: torch.Tensor | None = None,  # [N] fp32, detached: a weight per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group soft cross-entropy sums `[G]` (differentiable), top-1 hits `[G]` and row
    counts `[G]` (fp32), without keeping `[N, V]` logits (module docstring). `loss`: another
    per-row loss of `drafttrain.objectives.loss_fns` in place of soft cross-entropy (same machinery: its
    closed-form logit gradient per chunk). `row_weight`: the loss sums are `sum_n w_n
    loss_n` (weights known before the call, e.g. D-PACE's from a first pass).

    A small problem (`N * V <= min(chunk_elements, PLAIN_ELEMENTS)`: the CPU recipes) runs the
    plain formula, `linear_soft_ce_ref`: its logits are smaller than one chunk, and its numbers
    are bit-for-bit those of the per-row formulation training used before (the golden losses
    of the tiny recipes are pinned to them; the chunked path reassociates the sums)."""
    if hidden.shape[0] * weight.shape[0] <= min(chunk_elements, PLAIN_ELEMENTS):
        return linear_soft_ce_ref(
            hidden, weight, probs, rows, top1, group, groups, loss, row_weight
        )
    chunk = max(1, chunk_elements // weight.shape[0])
    dtype = _compute_dtype(hidden, weight)
    grads = torch.is_grad_enabled()  # no gradient work in an evaluation pass
    rw = None if row_weight is None else row_weight.detach().float()
    return _LinearSoftCE.apply(
        hidden, weight, probs, rows, top1, group, groups, chunk, dtype, grads, loss, rw
    )


def linear_soft_ce_ref(
    hidden, weight, probs, rows, top1, group, groups: int = 1, loss=SOFT_CE, row_weight=None
):
    """The plain formula, logits materialized (same signature and outputs): per row
    `-(p * log_softmax(z.float())).sum(-1)` (or `loss.ref`), times `row_weight`, then one
    masked sum per group."""
    logits = F.linear(hidden, weight)  # [N, V]
    if loss.is_soft_ce:
        ce = -(probs[rows] * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [N]
    else:
        ce = loss.ref(logits, probs[rows])
    if row_weight is not None:
        ce = ce * row_weight.detach().float()
    hit = logits.argmax(-1) == top1[rows]  # [N]
    loss, hits, count = [], [], []
    for g in range(groups):
        counted = group == g
        loss.append((ce * counted).sum())
        hits.append((hit & counted).sum().float())
        count.append(counted.sum().float())
    return torch.stack(loss), torch.stack(hits), torch.stack(count)


# ---- per-row losses: weights decided after the forward (D-PACE) ------------------------------
class RowCE(NamedTuple):
    """`linear_soft_ce_rows`' outputs, one entry per hidden row."""

    ce: torch.Tensor  # [N] fp32 soft cross-entropy, differentiable w.r.t. the hidden rows
    hit: torch.Tensor  # [N] bool: argmax z == the label row's top-1
    logp_top1: torch.Tensor  # [N] fp32 log-probability the draft gives the label's top-1
    cand: torch.Tensor | None  # [N, topk] int64: the draft's top-k ids (None when topk=0)


class _LinearSoftCERows(torch.autograd.Function):
    """Per-row soft cross-entropy of a *frozen* head, logits never kept: forward makes the
    unscaled `d ce[n] / d h[n] = (softmax(z) * sum(p) - p) @ W` per chunk, backward scales
    row n by its incoming gradient (any per-row weight, known only after the forward)."""

    @staticmethod
    def forward(ctx, hidden, weight, probs, rows, top1, topk, chunk, dtype, grads, loss):
        N, dev = hidden.shape[0], hidden.device
        ce = torch.empty(N, dtype=torch.float32, device=dev)
        hit = torch.empty(N, dtype=torch.float32, device=dev)
        logp1 = torch.empty(N, dtype=torch.float32, device=dev)
        cand = torch.empty(N, topk, dtype=torch.long, device=dev)
        grad_h = torch.empty_like(hidden) if grads else None
        w = weight.to(dtype)
        with torch.autocast(dev.type, enabled=False):
            for lo in range(0, N, chunk):
                hi = min(N, lo + chunk)
                z = F.linear(hidden[lo:hi].to(dtype), w)  # [c, V]
                r = rows[lo:hi]
                lse, ce[lo:hi], hit[lo:hi] = cuda_compiled_call(
                    _forward_chunk, z, probs, r, top1, loss
                )
                logp1[lo:hi] = z.gather(1, top1[r][:, None])[:, 0].float() - lse
                if topk:
                    cand[lo:hi] = z.topk(topk, dim=-1).indices
                if grads:
                    ones = torch.ones(hi - lo, dtype=torch.float32, device=dev)
                    dz = cuda_compiled_call(_backward_chunk, z, lse, probs, r, ones, loss)
                    grad_h[lo:hi] = dz @ w
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(hit, logp1, cand)
        return ce, hit, logp1, cand

    @staticmethod
    def backward(ctx, grad_ce, _hit, _logp1, _cand):
        (grad_h,) = ctx.saved_tensors
        return ((grad_h * grad_ce[:, None].to(grad_h.dtype)),) + (None,) * 9


def linear_soft_ce_rows(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H] a frozen head (no gradient)
    probs: torch.Tensor,  # [M, V] soft labels
    rows: torch.Tensor,  # [N] int64 label row of each hidden row
    top1: torch.Tensor,  # [M] int64 argmax of each label row
    topk: int = 0,
    chunk_elements: int = CHUNK_ELEMENTS,
    loss: RowLoss = SOFT_CE,
) -> RowCE:
    """Per-row soft cross-entropy (differentiable w.r.t. `hidden`), top-1 agreement, the
    draft's log-probability of the label's top-1 and (with `topk`) the draft's top-k ids,
    without keeping `[N, V]` logits. The caller weights and sums the rows itself (per-row
    weights that depend on the forward, e.g. D-PACE). Small problems run the plain formula
    (`linear_soft_ce_rows_ref`); larger ones need a frozen head. `loss`: another per-row loss
    of `drafttrain.objectives.loss_fns` in place of soft cross-entropy (`ce` is then that loss)."""
    if hidden.shape[0] * weight.shape[0] <= min(chunk_elements, PLAIN_ELEMENTS):
        return linear_soft_ce_rows_ref(hidden, weight, probs, rows, top1, topk, loss)
    if weight.requires_grad:
        raise ValueError("linear_soft_ce_rows: the chunked path needs a frozen head")
    chunk = max(1, chunk_elements // weight.shape[0])
    dtype = _compute_dtype(hidden, weight)
    grads = torch.is_grad_enabled() and hidden.requires_grad
    ce, hit, logp1, cand = _LinearSoftCERows.apply(
        hidden, weight, probs, rows, top1, topk, chunk, dtype, grads, loss
    )
    return RowCE(ce, hit.bool(), logp1, cand if topk else None)


def linear_soft_ce_rows_ref(
    hidden, weight, probs, rows, top1, topk: int = 0, loss: RowLoss = SOFT_CE
) -> RowCE:
    """The plain formula of `linear_soft_ce_rows` (same arguments), logits materialized."""
    logits = F.linear(hidden, weight)  # [N, V]
    logp = F.log_softmax(logits.float(), dim=-1)
    if loss.is_soft_ce:
        ce = -(probs[rows].float() * logp).sum(-1)
    else:
        ce = loss.ref(logits, probs[rows].float())
    hit = logits.argmax(-1) == top1[rows]
    logp1 = logp.detach().gather(1, top1[rows][:, None])[:, 0]
    cand = logits.detach().topk(topk, dim=-1).indices if topk else None
    return RowCE(ce, hit, logp1, cand)
