"""How far a drafter's per-draft confidence can be trusted, and the threshold it pays to cut at.

Events (one definition, `confidence_events`): in a round that verified `n` drafts and accepted
`a` of them, draft j (1-based) was *reached* if drafts 1..j-1 were all accepted and j was
verified (`j <= min(a + 1, n)`); a reached draft's event is 1 if it was accepted (`j <= a`),
else 0 (the first rejection). Drafts never reached (after a rejection, or after a confidence
cut) say nothing about their confidence and are left out. The confidence `c_j` is the
proposer's (`Proposer.confidences()`, `draftinfer.decoding.confidence`), an estimate of
P(draft j accepted | drafts 1..j-1 accepted), which is exactly what the event samples.

Metrics over the reached drafts (pure functions, no sklearn):
- ECE: 10 equal-width bins of confidence ([0, 0.1), ..., [0.9, 1.0]); sum over bins of
  (bin share) * |mean confidence - acceptance rate|. 0 = calibrated; it is in the same units
  as a probability (0.1 = confidences off by ten points on average).
- AUROC: P(a random accepted draft has a higher confidence than a random rejected one), ties
  counting one half (Mann-Whitney through average ranks). 0.5 = no ranking power; what a
  threshold cut needs most (it only ranks).
- Brier: mean of (c - event)^2; 0.25 is what a constant 0.5 scores on balanced events.

Threshold sweep (`threshold_sweep`): from rounds run on the whole block with their
confidences recorded, a cut at `tau` would have verified `cut = cut_lengths(conf, tau)`
(capped at the round's `n`) drafts and accepted `min(a, cut)` of them (the first drafts do not
depend on how many are verified; the accept decisions of drafts 1..cut read the same
randomness). With a round cost per number of verified drafts (`round_cost_at`: the
`round_costs=` file of `draftbench.round`, plain decode steps per K, the cost model
`choose_k` uses), the expected speedup at `tau` is tokens / cost summed over the rounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftinfer.decoding.confidence import cut_lengths

ECE_BINS = 10


def confidence_events(
    confidences: Sequence[Sequence[float]], accepted: Sequence[int], verified: Sequence[int]
) -> tuple[list[float], list[int]]:
    """Per round: its K confidences, accepted count `a` and verified count `n` -> the reached
    drafts' (confidence, accepted 0/1), in round order (module docstring)."""
    if not len(confidences) == len(accepted) == len(verified):
        raise ValueError("confidences, accepted and verified need one entry per round")
    conf, event = [], []
    for c, a, n in zip(confidences, accepted, verified):
        if a > n or n > len(c):
            raise ValueError(f"a round needs accepted <= verified <= K, got {a}, {n}, K={len(c)}")
        for j in range(min(a + 1, n)):
            conf.append(float(c[j]))
            event.append(int(j < a))
    return conf, event


def expected_calibration_error(
    conf: Sequence[float], event: Sequence[int], bins: int = ECE_BINS
) -> float:
    """ECE over `bins` equal-width bins of [0, 1] (1.0 falls in the last); NaN if empty."""
    if not conf:
        return float("nan")
    sums: dict[int, list[float]] = {}
    for c, e in zip(conf, event, strict=True):
        b = min(int(c * bins), bins - 1)
        s = sums.setdefault(b, [0.0, 0.0, 0.0])
        s[0], s[1], s[2] = s[0] + 1, s[1] + c, s[2] + e
    return sum(n / len(conf) * abs(sc / n - se / n) for n, sc, se in sums.values())


def auroc(conf: Sequence[float], event: Sequence[int]) -> float:
    """Area under the ROC of `conf` scoring `event`, via average ranks (ties count 1/2);
    NaN without both classes."""
    pos = sum(event)
    neg = len(event) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    ranks = [0.0] * len(conf)
    i = 0
    while i < len(order):  # ranks 1..N, tied values share their average rank
        j = i
        while j + 1 < len(order) and conf[order[j + 1]] == conf[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2 + 1
        i = j + 1
    rank_sum = sum(r for r, e in zip(ranks, event) if e)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def brier_score(conf: Sequence[float], event: Sequence[int]) -> float:
    """Mean squared difference of confidence and event; NaN if empty."""
    if not conf:
        return float("nan")
    return sum((c - e) ** 2 for c, e in zip(conf, event, strict=True)) / len(conf)


def calibration_report(outputs) -> dict:
    """ECE, AUROC and Brier of the reached drafts of `outputs` (`RequestOutput`s of a run with
    `record_confidence=True`), with how many there were, their acceptance rate and mean
    confidence."""
    conf, event = [], []
    for o in outputs:
        c, e = confidence_events(o.confidences, o.accepted, o.proposed)
        conf += c
        event += e
    n = len(conf)
    return {
        "drafts": n,
        "accept_rate": sum(event) / n if n else float("nan"),
        "mean_confidence": sum(conf) / n if n else float("nan"),
        "ece": expected_calibration_error(conf, event),
        "auroc": auroc(conf, event),
        "brier": brier_score(conf, event),
    }


def round_cost_at(round_cost: dict[int, float], n: int) -> float:
    """The cost of a round that verifies `n` drafts, in plain decode steps, from costs measured
    per K (`draftbench.round --costs-out`): linear between measured K, the nearest measured K
    outside them (a round verifying fewer drafts than any measured K costs at least that
    round's drafting, so the smallest K's cost is the conservative floor)."""
    ks = sorted(int(k) for k in round_cost)
    if not ks:
        raise ValueError("round_cost_at needs at least one measured K")
    cost = {int(k): float(v) for k, v in round_cost.items()}
    if n <= ks[0]:
        return cost[ks[0]]
    if n >= ks[-1]:
        return cost[ks[-1]]
    hi = next(k for k in ks if k >= n)
    lo = max(k for k in ks if k <= n)
    if hi == lo:
        return cost[lo]
    return cost[lo] + (cost[hi] - cost[lo]) * (n - lo) / (hi - lo)


def threshold_sweep(
    outputs, taus: Sequence[float], round_cost: dict[int, float] | None = None
) -> dict:
    """For each `tau` (None = the whole block) the AL, verified rows per round (drafts + the
    pending token's row) and, with `round_cost`, the mean round cost and expected speedup
    (tokens / cost), replayed from whole-block rounds with recorded confidences (module
    docstring). -> {"by_tau": {str(tau): {...}}, "best": tau of the highest expected
    speedup (None without costs)}."""
    rounds = [
        (c, a, n)
        for o in outputs
        for c, a, n in zip(o.confidences, o.accepted, o.proposed, strict=True)
    ]
    by_tau: dict[str, dict] = {}
    for tau in [None, *taus]:
        tokens = rows = cost = 0.0
        for c, a, n in rounds:
            cut = n if tau is None else min(n, int(cut_lengths(torch.tensor([c]), tau)[0]))
            tokens += min(a, cut) + 1
            rows += cut + 1
            cost += round_cost_at(round_cost, cut) if round_cost else 0.0
        r = max(len(rounds), 1)
        entry = {"al": tokens / r, "verified_rows_per_round": rows / r}
        if round_cost:
            entry["round_cost"] = cost / r
            entry["expected_speedup"] = tokens / cost if cost else float("nan")
        by_tau["full" if tau is None else str(tau)] = entry
    best = None
    if round_cost and rounds:
        best = max(by_tau, key=lambda t: by_tau[t]["expected_speedup"])
    return {"rounds": len(rounds), "by_tau": by_tau, "best": best}
