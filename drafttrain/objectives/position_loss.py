"""Scoring draft positions with `trainer.loss`, and D-PACE row weights for any layout.

D-PACE (`drafttrain.objectives.loss_weights.dpace_weights`) weights draft position k of an *anchor* (a
TTT chain from one row, a parallel rollout, a block) by the draft's survival probability up
to k and beyond, from the draft's detached probability of the target's top-1 at every
position of that anchor. An objective lays its rows out its own way (one tensor per TTT step
or MTP module, or one flat tensor of rows and slots); it describes each part by the rows'
anchor id and position, and gets back one weight per row. The weights depend on all
positions of an anchor, so they come from a first, gradient-free pass over the head
(`linear_soft_ce_rows` on detached inputs: one more head matmul per row, never the `[N, V]`
logits on the chunked path); the objective then passes them as `row_weight` to
`linear_soft_ce`.

`score_positions` is the whole loss call of an objective with one head call per draft
position (a TTT step, an MTP module): the loss of `drafttrain.objectives.loss_fns`, D-PACE weights when
it asks for them (replacing the kind's own per-position weights), the sums into `DraftLoss`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from drafttrain.objectives.fused_ce import linear_soft_ce, linear_soft_ce_rows
from drafttrain.objectives.loss_fns import RowLoss
from drafttrain.objectives.loss_weights import dpace_weights
from drafttrain.objectives.losses import DraftLoss


class RowPart(NamedTuple):
    """Rows of one head call."""

    hidden: torch.Tensor  # [N, H] the head's input
    rows: torch.Tensor  # [N] int64 label row of each hidden row
    anchor: torch.Tensor  # [N] int64 anchor id in [0, num_anchors)
    position: torch.Tensor  # [N] int64 draft position in [0, num_positions)
    valid: torch.Tensor  # [N] bool: scored rows


def _dpace_weights_of(
    parts: list[RowPart],
    logp_top1: list[torch.Tensor],  # [N] per part: the draft's log-probability of the top-1
    num_anchors: int,
    num_positions: int,
    alpha: float,
) -> list[torch.Tensor]:
    """D-PACE weight `[N]` fp32 per part (0 on invalid rows), from every part's detached
    probability of the target's top-1."""
    dev = logp_top1[0].device
    prob = torch.zeros(num_anchors * num_positions, dtype=torch.float32, device=dev)
    seen = torch.zeros(num_anchors * num_positions, dtype=torch.bool, device=dev)
    cells = []
    for p, lp in zip(parts, logp_top1):
        cell = torch.where(p.valid, p.anchor * num_positions + p.position, 0)
        prob.index_put_((cell[p.valid],), lp.detach().exp()[p.valid])
        seen.index_put_((cell[p.valid],), torch.ones_like(cell[p.valid], dtype=torch.bool))
        cells.append(cell)
    w = dpace_weights(
        prob.view(num_anchors, num_positions), seen.view(num_anchors, num_positions), alpha
    ).flatten()
    return [torch.where(p.valid, w[c], 0.0) for p, c in zip(parts, cells)]


@torch.no_grad()
def dpace_row_weights(
    parts: list[RowPart],
    weight: torch.Tensor,  # [V, H] the head
    probs: torch.Tensor,  # [M, V] soft labels
    top1: torch.Tensor,  # [M] int64 target top-1 of each label row
    num_anchors: int,
    num_positions: int,
    alpha: float = 0.5,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(D-PACE weight `[N]` fp32 per part, 0 on invalid rows; the plain soft cross-entropy
    `[N]` fp32 per part, for the logged per-position loss)."""
    rs = [
        linear_soft_ce_rows(p.hidden.detach(), weight.detach(), probs, p.rows, top1) for p in parts
    ]
    w = _dpace_weights_of(parts, [r.logp_top1 for r in rs], num_anchors, num_positions, alpha)
    return w, [r.ce for r in rs]


def _score_dpace_frozen_head(
    out: DraftLoss,
    parts: list[RowPart],
    weight: torch.Tensor,
    probs: torch.Tensor,
    top1: torch.Tensor,
    loss: RowLoss,
    num_anchors: int,
) -> None:
    """`score_positions` with D-PACE and a frozen head in one pass over the head: each
    part's per-row loss with its unscaled input gradient (`linear_soft_ce_rows`: one head
    GEMM and one `dz @ W` per chunk), the weights from those rows' probabilities, then the
    weighted sums; backward scales the kept row gradients by the weights. The two-pass form
    (`dpace_row_weights`, then `linear_soft_ce` with the weights) computes the head's logits
    twice; it stays for a trained head, whose weight gradient needs the weights inside the
    pass."""
    rs = [linear_soft_ce_rows(p.hidden, weight, probs, p.rows, top1, loss=loss) for p in parts]
    ws = _dpace_weights_of(parts, [r.logp_top1 for r in rs], num_anchors, len(parts), 0.5)
    for k, (p, r, w) in enumerate(zip(parts, rs, ws)):
        loss_sum = torch.where(p.valid, r.ce * w, 0.0).sum()
        shown = torch.where(p.valid, r.ce.detach(), 0.0).sum()
        out.add_sums(k, loss_sum, (r.hit & p.valid).sum(), p.valid.sum(), 1.0, reported=shown)


def score_positions(
    out: DraftLoss,
    parts: list[RowPart],  # part k: the rows of draft position k
    weight: torch.Tensor,  # [V, H] the head
    probs: torch.Tensor,  # [M, V] soft labels
    top1: torch.Tensor,  # [M] int64
    loss: RowLoss,
    position_weights: list[float],  # the kind's own weight of each position
    num_anchors: int,
) -> None:
    """Position k's loss sum, hits and count from `linear_soft_ce` with `loss` into `out`;
    with a D-PACE loss the rows carry D-PACE weights, every position weighs 1 and `loss_k`
    logs the plain soft cross-entropy."""
    if loss.weights_dpace and not weight.requires_grad:
        _score_dpace_frozen_head(out, parts, weight, probs, top1, loss, num_anchors)
        return
    row_w, plain = None, None
    if loss.weights_dpace:
        row_w, plain = dpace_row_weights(parts, weight, probs, top1, num_anchors, len(parts))
    for k, p in enumerate(parts):
        loss_sum, hits, count = linear_soft_ce(
            p.hidden,
            weight,
            probs,
            p.rows,
            top1,
            p.valid.long() - 1,
            loss=loss,
            row_weight=None if row_w is None else row_w[k],
        )
        shown = None if plain is None else (plain[k] * p.valid).sum()
        w = 1.0 if row_w is not None else position_weights[k]
        out.add_sums(k, loss_sum[0], hits[0], count[0], w, reported=shown)
