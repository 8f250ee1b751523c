"""Acceptance metrics (DESIGN convention 11): one definition, used by the runner, reports
and model cards.

- A *round* drafts `k_r` tokens for one request and the target accepts `a_r` of them
  (0 <= a_r <= k_r), then emits one more (recovered or bonus), so a round yields `a_r + 1`
  tokens.
- *Acceptance length* AL = mean over rounds of `a_r + 1` (the *micro* average: every round of
  every request counts once; NeMo Automodel, speculators and SpecForge report this one, from
  the engines' global counters).
- *Macro AL* = the mean over requests of each request's AL (vLLM's acceptance tests and
  z-lab's benchmark report this one); a long request weighs as much as a short one.
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


def macro_acceptance_length(accepted_by_request: Sequence[Sequence[int]]) -> float:
    """Mean over requests of `acceptance_length` of each request's rounds; requests without
    rounds (nothing drafted) are left out; NaN when no request has a round."""
    per_request = [acceptance_length(a) for a in accepted_by_request if len(a)]
    if not per_request:
        return float("nan")
    return sum(per_request) / len(per_request)


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
