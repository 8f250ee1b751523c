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

from collections.abc import Callable, Sequence


def acceptance_length(accepted: Sequence[int]) -> float:
    """Mean of `a_r + 1` over rounds; NaN with no rounds."""
    if len(accepted) == 0:
        return float("nan")
    return sum(a + 1 for a in accepted) / len(accepted)


def al_by_version(outputs) -> dict[int, dict[str, float]]:
    """AL per drafter version over the rounds of `outputs` (each with `accepted` and
    `versions` per round, `draftinfer.decoding.engine.RequestOutput`): version ->
    {"al": `acceptance_length` of its rounds, "rounds": how many}, versions in order."""
    by: dict[int, list[int]] = {}
    for o in outputs:
        for a, v in zip(o.accepted, o.versions, strict=True):
            by.setdefault(v, []).append(a)
    return {v: {"al": acceptance_length(by[v]), "rounds": len(by[v])} for v in sorted(by)}


def walk_rounds(accepted_after: Callable[[int], int], n: int, stopped: bool) -> list[int]:
    """The accepted counts of the runner's rounds over a greedy continuation of `n` tokens,
    from `accepted_after(s)`: the drafts a round started after continuation token `s`
    accepts (token 0 comes from the prefill; each round then adds its accepted drafts and one
    token of the target's, so the next round starts `a + 1` tokens later). At the end, as the
    runner counts (`SpecDecoder`: a round's accepted drafts before its stop check, as vLLM's
    spec-decode metrics count them): the round that reaches the continuation's end-of-sequence
    (`stopped`) keeps its whole count, drafts accepted past that token included; a
    continuation cut by the token budget has its last rounds' drafts capped by what the
    budget leaves after the target's token. The training-time walk AL
    (`drafttrain.jobs.walk_al`) and `draftbench.al_gap` replay the runner's walk with it."""
    out, s = [], 0
    while s < n - 1:
        a = accepted_after(s)
        acc = a if stopped else min(a, n - 2 - s)
        out.append(acc)
        s += acc + 1
    return out


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


def choose_k(per_position: Sequence[float], round_cost: dict[int, float]) -> dict:
    """The number of drafts per round that maximises expected tokens per unit of time.

    `per_position[j - 1]` is the measured P(drafts 1..j all accepted) at the run's K
    (`per_position_acceptance`); a round that proposes only `k <= K` drafts accepts
    `min(a, k)` of them (the first `k` drafts of every kind here do not depend on how many
    follow), so it yields `1 + sum(per_position[:k])` tokens. `round_cost[k]` is the cost of a
    round at `k`, in plain decode steps (t_round / t_plain, measured by `draftbench.round`).
    Only `k` with both a measurement of acceptance (`k <= K`) and of cost are ranked.

    -> {"k": best k, "by_k": {k: {tokens_per_round, round_cost, expected_speedup}}};
    "k" is None where no k has both."""
    by_k = {}
    for k in sorted(int(x) for x in round_cost):
        if k > len(per_position) or any(p != p for p in per_position[:k]):  # NaN: unmeasured
            continue
        tokens = 1.0 + sum(per_position[:k])
        cost = float(round_cost[k])
        by_k[k] = {
            "tokens_per_round": tokens,
            "round_cost": cost,
            "expected_speedup": tokens / cost,
        }
    best = max(by_k, key=lambda k: by_k[k]["expected_speedup"], default=None)
    return {"k": best, "by_k": by_k}
