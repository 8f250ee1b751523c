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
    """Accumulates one batch's weighted loss and per-position metrics."""

    def __init__(self, device: torch.device):
        self.device = device
        self.metrics: dict[str, float] = {}
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
        s = (ce * valid).sum()
        self._sums.append(s)
        self._stats.append(
            torch.stack([s.detach().double(), (hit & valid).sum().double(), valid.sum().double()])
        )
        self._weights.append(weight)
        self._keys.append(k)

    def result(self, loss_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        stats = torch.cat([torch.stack(self._stats).flatten(), loss_mask.sum().double()[None]])
        par = _DATA_PARALLEL.get()
        if par is not None:
            reduce_sum, world = par
            stats = reduce_sum(stats)
        stats = stats.tolist()  # the step's one host sync
        total = torch.zeros((), device=self.device)
        surv, sim_al, loss = 1.0, 1.0, 0.0
        for i, (k, s, w) in enumerate(zip(self._keys, self._sums, self._weights)):
            loss_sum, hits, count = stats[3 * i : 3 * i + 3]
            n = max(count, 1.0)
            total = total + w * (s / n)
            acc = hits / n
            surv *= acc
            sim_al += surv
            self.metrics[f"loss_{k}"] = loss_sum / n
            loss += w * loss_sum / n
            self.metrics[f"acc_{k}"] = acc
        if par is not None and world > 1:
            total = total * world
        self.metrics["loss"] = loss  # the whole batch's, whatever the number of ranks
        self.metrics["sim_al"] = sim_al
        self.metrics["tokens"] = stats[-1]
        return total, self.metrics
