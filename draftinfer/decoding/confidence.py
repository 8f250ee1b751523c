"""Per-draft confidence and the confidence cut of a round's block (confidence-driven
verification, `SpecDecoder(verify_threshold=tau)`).

Vocabulary. A draft's *confidence* `c_j` (j = 1..K) is the drafter's estimate of
P(draft j accepted | drafts 1..j-1 accepted). A proposer exposes `[B, K]` of them through one
seam (`Proposer.confidences()`): a kind with a learned head gives its own (DSpark's
confidence head, `kinds/dflash/proposer.py`), every other kind the *derived* confidence,
defined once here (`derived_confidence`): the drafter's own probability of its most likely
token at the slot, `max softmax(draft logits)` at temperature 1, over the logits the draft is
chosen from (DSpark's Markov bias or DFlash2's selector included). Where drafts are the argmax
(`verify=onehot`, the default, and every greedy row) that is exactly the probability of the
chosen draft. Where drafts are *sampled* from q (`verify=full`) it is deliberately not the
sampled token's probability: see "Why it is lossless".

The *cut*. The cumulative confidence `C_j = c_1 * ... * c_j` estimates P(drafts 1..j all
accepted). A request's block is cut at the first slot whose cumulative confidence falls
below `tau`: `cut = #{j : C_1..C_j >= tau}` drafts are verified, the rest are padding of the
verify forward (no KV write, never accepted). Shapes stay static (`[B, K]` in, `[B]` out, no
host sync), so the round is graph-captured as before.

Why it is lossless: whether slot j is verified may depend on the context of draft j (the
committed prefix and drafts 1..j-1) and on nothing the target draws, but not on the value of
draft j itself. Then, given everything emitted before position j, the token there is either
the verified draft's accept/recover outcome (an exact sample of p, averaged over d_j ~ q) or,
at the cut, the bonus token sampled from the target's distribution right after the last
verified draft (`Verifier.verify` reads `logits[b, num_drafts[b]]`, bonus rule): an exact
sample either way; greedy rows emit exactly the plain greedy tokens. A confidence that looks
at the sampled d_j (e.g. q(d_j)) would select which sampled drafts get verified, and the
accepted ones would no longer average to p: the sampling harness measured that bias
(p ~ 1e-40 on the joint of three tokens, `tests/infer/test_confidence_verify.py`). Both
confidences here qualify: the derived one is a function of slot j's logits (the context),
DSpark's head reads the block forward's hidden state of slot j (the anchor and mask tokens,
never the drafts).
"""

from __future__ import annotations

import torch


def derived_confidence(logits: torch.Tensor) -> torch.Tensor:
    """The drafter's probability of its most likely token, `max softmax(logits)` in fp32 (the
    chosen draft's probability where drafts are the argmax; never the sampled token's, module
    docstring). logits `[..., Dd]` over the draft vocabulary -> `[...]` fp32 in (0, 1]."""
    return torch.softmax(logits.float(), dim=-1).amax(-1)


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
