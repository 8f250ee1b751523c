"""Linear + soft cross-entropy that never keeps the logits: the drafter's head and its loss
in one autograd function, chunked over rows.

For rows `n` with normed hidden `h[n] [H]`, head weight `W [V, H]`, soft labels
`p[row[n]] [V]` (a row of a target-distribution table, `drafttrain.target_head`), the
target's top-1 `top1[row[n]]` and a group `group[n]` (-1: not counted):

    z[n]     = h[n] @ W^T                               (the drafter's logits, never stored)
    ce[n]    = -sum_v p[n, v] * log_softmax(z[n])[v] = lse(z[n]) * sum_v p[n, v] - p[n] . z[n]
    loss[g]  = sum_{n: group[n] = g} ce[n]             (differentiable, fp32)
    hits[g]  = #{n in g: argmax z[n] == top1[row[n]]}
    count[g] = #{n in g}

Forward computes `z` one chunk of rows at a time (the matmul in the autocast dtype, or the
inputs' dtype without autocast; softmax statistics in fp32) and keeps only `lse [N]`. The
per-chunk elementwise math is one compiled kernel each way on CUDA (eager elsewhere).
Backward recomputes each chunk's `z` and applies `dce/dz = softmax(z) * sum(p) - p` scaled by
the group's incoming gradient: `grad_h = dz @ W`, `grad_W = sum_chunks dz^T @ h` (fp32
accumulation). Peak extra memory is a few `[chunk, V]` fp32 buffers instead of `[N, V]` logits
plus their fp32 log-softmax per draft position. The label table is read through `row`, so an
objective that scores rows against shifted targets (TTT step k: row i against target row
i+1+k) passes an index, never a shifted copy of the table.

`linear_soft_ce_ref` is the plain formula (the test oracle).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

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


def _forward_chunk(z: torch.Tensor, p: torch.Tensor):
    """z `[c, V]` logits, p `[c, V]` labels -> (lse `[c]`, ce `[c]` fp32, argmax `[c]`)."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    ce = ((lse[:, None] - zf) * p.float()).sum(-1)  # -sum p * log_softmax(z)
    return lse, ce, z.argmax(-1)


def _backward_chunk(z: torch.Tensor, lse: torch.Tensor, p: torch.Tensor, s: torch.Tensor):
    """d(sum_n s_n ce_n) / dz = s * (softmax(z) * sum(p) - p), `[c, V]` in z's dtype; exactly
    0 on rows with s = 0 (uncounted rows, whatever their logits)."""
    pf = p.float()
    q = torch.exp(z.float() - lse[:, None])
    dz = (q * pf.sum(-1, keepdim=True) - pf) * s[:, None]
    return torch.where(s[:, None] != 0, dz, 0.0).to(z.dtype)


# On CUDA the chunk math runs as one fused kernel each way (torch.compile, dynamic shapes: one
# compilation for every chunk size); eager elsewhere. Compiled functions are cached per name,
# as `drafttrain.ttt.flex_fn` caches flex attention.
_COMPILED: dict[str, object] = {}


def _chunk_call(fn, *args):
    if args[0].device.type != "cuda":
        return fn(*args)
    name = fn.__name__
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    f = _COMPILED[name]
    try:
        return f(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compiler failure must not stop training: say so, run eagerly
        if f is fn:
            raise
        msg = f"torch.compile of {name} failed ({type(e).__name__}: {e}); eager from now on"
        warnings.warn(msg, stacklevel=2)
        _COMPILED[name] = fn
        return fn(*args)


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, probs, rows, top1, group, groups, chunk, dtype):
        N = hidden.shape[0]
        dev = hidden.device
        loss = torch.zeros(groups, dtype=torch.float32, device=dev)
        hits = torch.zeros(groups, dtype=torch.float32, device=dev)
        count = torch.zeros(groups, dtype=torch.float32, device=dev)
        lse = torch.empty(N, dtype=torch.float32, device=dev)
        w = weight.to(dtype)
        with torch.autocast(dev.type, enabled=False):
            for lo in range(0, N, chunk):
                hi = min(N, lo + chunk)
                z = F.linear(hidden[lo:hi].to(dtype), w)  # [c, V]
                r, g = rows[lo:hi], group[lo:hi]
                lse_c, ce, top = _chunk_call(_forward_chunk, z, probs.index_select(0, r))
                lse[lo:hi] = lse_c
                hit = (top == top1.index_select(0, r)).float()  # [c]
                loss += _group_sums(ce, g, groups)
                hits += _group_sums(hit, g, groups)
                count += _group_sums(torch.ones_like(hit), g, groups)
        ctx.save_for_backward(hidden, weight, probs, rows, group, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(hits, count)
        return loss, hits, count

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits, _grad_count):
        hidden, weight, probs, rows, group, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N = hidden.shape[0]
        dev = hidden.device
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
        w = weight.to(dtype)
        # Incoming gradient of each row's group (0 for rows no group counts).
        scale_of = torch.cat([grad_loss.float(), grad_loss.new_zeros(1, dtype=torch.float32)])
        with torch.autocast(dev.type, enabled=False):
            for lo in range(0, N, chunk):
                hi = min(N, lo + chunk)
                h = hidden[lo:hi].to(dtype)
                g = group[lo:hi]
                s = scale_of[torch.where(g >= 0, g, grad_loss.shape[0])]  # [c]
                z = F.linear(h, w)  # recomputed, [c, V]
                p = probs.index_select(0, rows[lo:hi])
                dz = _chunk_call(_backward_chunk, z, lse[lo:hi], p, s)
                if need_h:
                    grad_h[lo:hi] = dz @ w
                if need_w:
                    grad_w.add_(dz.t() @ h)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_soft_ce(
    hidden: torch.Tensor,  # [N, H] normed hidden states (the head's input)
    weight: torch.Tensor,  # [V, H] head weight
    probs: torch.Tensor,  # [M, V] soft labels (rows of a target distribution)
    rows: torch.Tensor,  # [N] int64: the label row of each hidden row
    top1: torch.Tensor,  # [M] int64: the target's argmax of each label row
    group: torch.Tensor,  # [N] int64: the loss group of each row, -1 = not counted
    groups: int = 1,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group soft cross-entropy sums `[G]` (differentiable), top-1 hits `[G]` and row
    counts `[G]` (fp32), without keeping `[N, V]` logits (module docstring).

    A small problem (`N * V <= min(chunk_elements, PLAIN_ELEMENTS)`: the CPU recipes) runs the
    plain formula, `linear_soft_ce_ref`: its logits are smaller than one chunk, and its numbers
    are bit-for-bit those of the per-row formulation training used before (the golden losses
    of the tiny recipes are pinned to them; the chunked path reassociates the sums)."""
    if hidden.shape[0] * weight.shape[0] <= min(chunk_elements, PLAIN_ELEMENTS):
        return linear_soft_ce_ref(hidden, weight, probs, rows, top1, group, groups)
    chunk = max(1, chunk_elements // weight.shape[0])
    dtype = _compute_dtype(hidden, weight)
    return _LinearSoftCE.apply(hidden, weight, probs, rows, top1, group, groups, chunk, dtype)


def linear_soft_ce_ref(hidden, weight, probs, rows, top1, group, groups: int = 1):
    """The plain formula, logits materialized (same signature and outputs): per row
    `-(p * log_softmax(z.float())).sum(-1)`, then one masked sum per group."""
    logits = F.linear(hidden, weight)  # [N, V]
    ce = -(probs[rows] * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [N]
    hit = logits.argmax(-1) == top1[rows]  # [N]
    loss, hits, count = [], [], []
    for g in range(groups):
        counted = group == g
        loss.append((ce * counted).sum())
        hits.append((hit & counted).sum().float())
        count.append(counted.sum().float())
    return torch.stack(loss), torch.stack(hits), torch.stack(count)
