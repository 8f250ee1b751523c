"""The per-draft loss and metrics every objective reports (one definition).

An objective scores D *draft positions* (TTT steps, parallel depths or MTP modules): at
position k each counted row has drafter logits and a target distribution. The loss is the
soft cross-entropy against the target's distribution, averaged over counted rows, weighted
per position; the metrics are `loss_k`, `acc_k` (top-1 agreement with the target) and the
*simulated acceptance length* `1 + sum_k prod_{s<=k} acc_s` (what greedy drafting would accept
if position errors were independent), plus `tokens` (loss-masked tokens of the batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """`-(p * log_softmax(logits)).sum(-1)` in fp32: logits and p `[..., V]` -> `[...]`."""
    return -(target_p * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def top1_agrees(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """Drafter argmax == target argmax, `[...]` bool."""
    return logits.argmax(-1) == target_p.argmax(-1)


class DraftLoss:
    """Accumulates one batch's weighted loss and per-position metrics."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), device=device)
        self.metrics: dict[str, float] = {}
        self._surv, self._sim_al = 1.0, 1.0

    def add(
        self,
        k: int,
        ce: torch.Tensor,  # [...] per-row soft cross-entropy
        hit: torch.Tensor,  # [...] bool, top-1 agreement
        valid: torch.Tensor,  # [...] bool, rows counted at position k
        weight: float,
    ) -> None:
        n = valid.sum().clamp(min=1)
        loss = (ce * valid).sum() / n
        self.total = self.total + weight * loss
        acc = ((hit & valid).sum() / n).item()
        self._surv *= acc
        self._sim_al += self._surv
        self.metrics[f"loss_{k}"] = loss.item()
        self.metrics[f"acc_{k}"] = acc

    def result(self, loss_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        self.metrics["sim_al"] = self._sim_al
        self.metrics["tokens"] = float(loss_mask.sum().item())
        return self.total, self.metrics
