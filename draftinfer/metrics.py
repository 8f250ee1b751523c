"""Acceptance metrics (DESIGN convention 11): one definition, used by the runner, reports
and model cards.

- A *round* drafts `k_r` tokens for one request and the target accepts `a_r` of them
  (0 <= a_r <= k_r), then emits one more (recovered or bonus), so a round yields `a_r + 1`
  tokens.
- *Acceptance length* AL = mean over rounds of `a_r + 1`.
- *Per-position acceptance* at draft position `j` (1-based) = among rounds that proposed at
  least `j` drafts, the fraction whose first `j` drafts were all accepted (`a_r >= j`).
"""

from __future__ import annotations

from collections.abc import Sequence


def acceptance_length(accepted: Sequence[int]) -> float:
    """Mean of `a_r + 1` over rounds; NaN with no rounds."""
    if len(accepted) == 0:
        return float("nan")
    return sum(a + 1 for a in accepted) / len(accepted)


def per_position_acceptance(
    accepted: Sequence[int], proposed: Sequence[int], k: int
) -> list[float]:
    """Fraction of rounds with `a_r >= j` among rounds with `k_r >= j`, for j = 1..k."""
    if len(accepted) != len(proposed):
        raise ValueError("accepted and proposed must have one entry per round")
    if any(a > p or a < 0 for a, p in zip(accepted, proposed)):
        raise ValueError("each round must satisfy 0 <= accepted <= proposed")
    out = []
    for j in range(1, k + 1):
        n = sum(1 for p in proposed if p >= j)
        hit = sum(1 for a, p in zip(accepted, proposed) if p >= j and a >= j)
        out.append(hit / n if n else float("nan"))
    return out
