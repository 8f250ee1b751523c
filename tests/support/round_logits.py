"""Fast path vs reference loop on the drafter's logits, round by round (issue 21 item 3), and
the reference loop's drafter inputs as it hands them over.

Both paths pick drafts through a draft chooser (`choose(logits [B, Dd], step)`), the one place
every kind's proposer hands over the logits it drafted from, so recording the chooser's
argument gives the drafter's logits per round and step for any kind: the engine's
`proposer.propose` (every live row of the padded batch) and the reference loop's
`reference_drafts` (one request, recomputed from scratch). A path that emitted the same tokens
from different logits (a stale cache that happens to keep the argmax) fails here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tests.support.utils import assert_close


@dataclass
class RefCall:
    """One `reference_drafts` call: its inputs as received (cloned before the call), whether
    the call left them as they were, and the logits of each step."""

    ids: torch.Tensor  # [R]
    features: torch.Tensor  # [R, F]
    rope_pos: torch.Tensor  # [R] or [3, R]
    mm: tuple[torch.Tensor, torch.Tensor] | None  # (mask [R], embeds [R, H])
    unchanged: bool = True
    logits: list[torch.Tensor] = field(default_factory=list)  # [Dd] per step


def record_fast(dec, mp) -> list[list[torch.Tensor]]:
    """Per `propose` call (round) of `dec`, the drafter's logits `[B, Dd]` of each step."""
    rounds: list[list[torch.Tensor]] = []
    propose = dec.proposer.propose

    def spy(fp, num_drafts, k, choose=None, *a, **kw):
        steps: list[torch.Tensor] = []
        rounds.append(steps)

        def keep(logits, step):
            steps.append(logits.detach().float().clone())
            return choose(logits, step)

        return propose(fp, num_drafts, k, keep, *a, **kw)

    mp.setattr(dec.proposer, "propose", spy)
    return rounds


def record_reference(proposer_class, mp) -> list[RefCall]:
    """Every `reference_drafts` call of the reference loop, in order (one per request round)."""
    calls: list[RefCall] = []
    original = proposer_class.reference_drafts

    def spy(drafter, ids, features, rope_pos, n, choose, mm=None):
        call = RefCall(
            ids.clone(),
            features.clone(),
            rope_pos.clone(),
            None if mm is None else (mm.mask.clone(), mm.embeds.clone()),
        )
        calls.append(call)

        def keep(logits, step):
            call.logits.append(logits.detach().float().reshape(-1, logits.shape[-1])[-1].clone())
            return choose(logits, step)

        out = original(drafter, ids, features, rope_pos, n, keep, mm)
        call.unchanged = (
            torch.equal(ids, call.ids)
            and torch.equal(features, call.features)
            and torch.equal(rope_pos, call.rope_pos)
            and (
                mm is None
                or (torch.equal(mm.mask, call.mm[0]) and torch.equal(mm.embeds, call.mm[1]))
            )
        )
        return out

    mp.setattr(proposer_class, "reference_drafts", staticmethod(spy))
    return calls


def compare_round_logits(fast_rounds, ref_calls: list[RefCall], outputs) -> int:
    """Request b ran in batch row b from the first round on (all admitted together): its round
    r is the fast path's r-th `propose` call, row b, and the reference loop's r-th call for it
    (the reference runs requests one after another). The logits of every step that drafted a
    token agree within fp32 noise. Returns the number of (round, step) pairs compared."""
    compared, call = 0, 0
    for b, out in enumerate(outputs):
        for r, n in enumerate(out.proposed):
            ref = ref_calls[call]
            call += 1
            assert len(ref.logits) == n, (b, r, len(ref.logits), n)
            for step in range(n):
                got = fast_rounds[r][step][b]
                want = ref.logits[step]
                scale = want.abs().max().clamp(min=1.0)
                assert_close(got / scale, want / scale)
                compared += 1
    assert call == len(ref_calls)
    return compared
