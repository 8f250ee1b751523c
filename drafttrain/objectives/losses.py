"""The per-draft loss and metrics every objective reports (one definition).

An objective scores D *draft positions* (TTT steps, parallel depths or MTP modules): at
position k each counted row has drafter logits and a target distribution. The loss is the
soft cross-entropy against the target's distribution, averaged over counted rows, weighted
per position; the metrics are `loss_k`, `acc_k` (top-1 agreement with the target) and the
*simulated acceptance length* `1 + sum_k prod_{s<=k} acc_s` (what greedy drafting would accept
if position errors were independent), plus `tokens` (loss-masked tokens of the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """`-(p * log_softmax(logits)).sum(-1)` in fp32: logits and p `[..., V]` -> `[...]`."""
    return -(target_p * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def top1_agrees(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """Drafter argmax == target argmax, `[...]` bool."""
    return logits.argmax(-1) == target_p.argmax(-1)


# Data parallelism (`data_parallel`): each rank scores its share of the global batch, but
# every mean is over the *global* batch. `result()` sums the per-position counts, loss sums
# and hits over ranks in one collective, divides each rank's loss sum by the global count and
# scales by the world size (DDP, DeepSpeed and FSDP average gradients over ranks), so the
# gradient and the logged metrics equal one process's on the whole batch.
_DATA_PARALLEL: ContextVar[tuple[Callable[[torch.Tensor], torch.Tensor], int] | None] = ContextVar(
    "draft_loss_data_parallel", default=None
)


@contextmanager
def data_parallel(reduce_sum: Callable[[torch.Tensor], torch.Tensor], world_size: int):
    """Inside: `DraftLoss` normalises by counts summed over ranks with `reduce_sum`."""
    token = _DATA_PARALLEL.set((reduce_sum, world_size))
    try:
        yield
    finally:
        _DATA_PARALLEL.reset(token)


class DraftLoss:
    """Accumulates one batch's weighted loss and per-position metrics, on the device: nothing
    here waits for the device (`result` returns tensors; the trainer reads them when it logs,
    `metric_values`)."""

    def __init__(self, device: torch.device):
        self.device = device
        # Values a kind adds besides the positions' (e.g. ptd's slot counts): floats or
        # 0-dim tensors, reported first.
        self.metrics: dict[str, float | torch.Tensor] = {}
        self._sums: list[torch.Tensor] = []  # per position: sum of ce over counted rows
        self._stats: list[torch.Tensor] = []  # per position: [loss sum, hits, count]
        self._weights: list[float] = []
        self._keys: list[int] = []

    def add(
        self,
        k: int,
        ce: torch.Tensor,  # [...] per-row soft cross-entropy
        hit: torch.Tensor,  # [...] bool, top-1 agreement
        valid: torch.Tensor,  # [...] bool, rows counted at position k
        weight: float,
    ) -> None:
        """Position k from per-row values."""
        self.add_sums(k, (ce * valid).sum(), (hit & valid).sum(), valid.sum(), weight)

    def add_sums(
        self,
        k: int,
        loss_sum: torch.Tensor,  # [] sum of ce over counted rows (differentiable)
        hits: torch.Tensor,  # [] counted rows whose top-1 agrees
        count: torch.Tensor,  # [] counted rows
        weight: float,
        reported: torch.Tensor | None = None,
    ) -> None:
        """Position k from sums over its counted rows (`drafttrain.objectives.fused_ce.linear_soft_ce`).
        `reported`: the sum logged as `loss_k` when it is not `loss_sum` itself (an objective
        whose per-row weights live inside `loss_sum` logs its plain per-row loss)."""
        self._sums.append(loss_sum)
        shown = (loss_sum if reported is None else reported).detach().double()
        self._stats.append(torch.stack([shown, hits.double(), count.double()]))
        self._weights.append(weight)
        self._keys.append(k)

    def result(self, loss_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss to back-propagate, metrics as 0-dim float64 tensors on the device)."""
        stats = torch.cat([torch.stack(self._stats).flatten(), loss_mask.sum().double()[None]])
        par = _DATA_PARALLEL.get()
        if par is not None:
            reduce_sum, world = par
            stats = reduce_sum(stats)
        metrics: dict[str, torch.Tensor] = {
            k: v if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
            for k, v in self.metrics.items()
        }
        total = torch.zeros((), device=self.device)
        one = torch.ones((), dtype=torch.float64, device=stats.device)
        surv, sim_al, loss = one, one, torch.zeros_like(one)
        # The same float64 operations, in the same order, as a host computation would do.
        for i, (k, s, w) in enumerate(zip(self._keys, self._sums, self._weights)):
            loss_sum, hits, count = stats[3 * i], stats[3 * i + 1], stats[3 * i + 2]
            n = count.clamp(min=1.0)
            total = total + w * (s / n.to(s.dtype))
            acc = hits / n
            surv = surv * acc
            sim_al = sim_al + surv
            metrics[f"loss_{k}"] = loss_sum / n
            loss = loss + w * loss_sum / n
            metrics[f"acc_{k}"] = acc
        if par is not None and world > 1:
            total = total * world
        metrics["loss"] = loss  # the whole batch's, whatever the number of ranks
        metrics["sim_al"] = sim_al
        metrics["tokens"] = stats[-1]
        return total, metrics


def metric_values(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Metrics as floats: one host sync for all of them (the trainer calls it when it logs)."""
    keys = list(metrics)
    tensors = [v for v in metrics.values() if torch.is_tensor(v)]
    if not tensors:
        return {k: float(v) for k, v in metrics.items()}
    dev = tensors[0].device
    vals = torch.stack(
        [
            (v if torch.is_tensor(v) else torch.tensor(float(v))).to(dev, torch.float64)
            for v in metrics.values()
        ]
    ).tolist()
    return dict(zip(keys, vals))
