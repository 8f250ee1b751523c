"""Per-draft confidence and the confidence cut of a round's block (confidence-driven
verification, `SpecDecoder(verify_threshold=tau)`).

Vocabulary. A draft's *confidence* `c_j` (j = 1..K) is the drafter's estimate of
P(draft j accepted | drafts 1..j-1 accepted). A proposer exposes `[B, K]` of them through one
seam (`Proposer.confidences()`): a kind with a learned head gives its own (DSpark's
confidence head, `kinds/dflash/proposer.py`), every other kind the *derived* confidence,
defined once here (`derived_confidence`): the probability of the chosen draft under the
drafter's own distribution, `softmax(draft logits)[draft]` at temperature 1, the logits the
draft was chosen from (DSpark's Markov bias or DFlash2's selector included).

The *cut*. The cumulative confidence `C_j = c_1 * ... * c_j` estimates P(drafts 1..j all
accepted). A request's block is cut at the first slot whose cumulative confidence falls
below `tau`: `cut = #{j : C_1..C_j >= tau}` drafts are verified, the rest are padding of the
verify forward (no KV write, never accepted). Shapes stay static (`[B, K]` in, `[B]` out, no
host sync), so the round is graph-captured as before.

Why it is lossless: the cut depends on the drafter alone (its logits, its head), never on the
target's randomness, so the round is ordinary speculative decoding with `cut` drafts: greedy
rows emit exactly the plain greedy tokens; sampled rows accept a prefix of the `cut` drafts
and then emit the target's recovered token at the first rejection, or, all `cut` accepted,
the bonus token sampled from the target's distribution right after the last verified draft
(`Verifier.verify` reads `logits[b, num_drafts[b]]`): an exact sample either way.
"""

from __future__ import annotations

import torch


def derived_confidence(logits: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """The drafter's probability of its chosen draft: `softmax(logits)[choice]` in fp32.
    logits `[..., Dd]` over the draft vocabulary, choice `[...]` draft-vocabulary ids ->
    `[...]` fp32 in [0, 1]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, choice[..., None]).squeeze(-1).exp()


def cut_lengths(confidence: torch.Tensor, tau: float) -> torch.Tensor:
    """Drafts to verify per request: the number of leading slots whose cumulative confidence
    (the product of the per-draft ones up to and including the slot) is at least `tau`.
    confidence `[B, K]` in [0, 1] -> `[B]` int64 in 0..K. No host sync."""
    cum = torch.cumprod(confidence.float().clamp(0.0, 1.0), dim=1)  # [B, K], non-increasing
    # cumprod of the 0/1 test keeps the count a prefix even if a NaN breaks monotonicity.
    return torch.cumprod((cum >= tau).long(), dim=1).sum(1)


def check_threshold(tau: float | None) -> float | None:
    """`verify_threshold` as the runner takes it: None (off, the whole block) or in (0, 1]."""
    if tau is None:
        return None
    tau = float(tau)
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"verify_threshold must be in (0, 1] (or null for off), got {tau}")
    return tau
