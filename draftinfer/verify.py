"""Verification of one round: target probabilities, seeded randomness and the rejection
sampler, for a padded batch of requests.

Modes:
- `onehot` (default): drafts are the drafter's argmax; q is one-hot, so a draft `d` is
  accepted with probability `p(d)` and the recovered token is drawn from `p` with `d`
  removed. Lossless for any deterministic draft choice.
- `full`: drafts are *sampled* from the drafter's own distribution q (temperature, top-k,
  top-p of the request) and verified with `min(1, p/q)`, recovering from `max(p - q, 0)`.

Randomness is keyed by (request seed, position of the token it decides) through
`draftinfer.sampling` (DESIGN 3.12). Greedy requests (temperature 0) accept while the draft
equals the target argmax and emit the argmax at the first mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from draftkernels.rejection_sampler import rejection_sample

from draftinfer.sampling import (
    STREAM_DRAFT,
    STREAM_RECOVERY,
    SamplingParams,
    exponential_noise,
    logits_to_probs,
    resolve_seed,
    sample_from_probs,
    sampling_tensors,
    uniforms_for,
)

VERIFY_MODES = ("onehot", "full")


def with_seed(params: SamplingParams) -> SamplingParams:
    """The request's params with its seed fixed (a fresh one when unseeded)."""
    return replace(params, seed=resolve_seed(params.seed))


class Verifier:
    def __init__(self, mode: str, drafter):
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify mode must be one of {VERIFY_MODES}, got {mode!r}")
        self.mode = mode
        self.drafter = drafter
        self.vocab = drafter.config.vocab_size

    @staticmethod
    def _params(params: Sequence[SamplingParams], device) -> dict[str, torch.Tensor]:
        """Per-request tensors incl. `seed [B]`; seeds are resolved when a request is admitted
        (`with_seed`), so a None here is a bug, not an unseeded request."""
        if any(p.seed is None for p in params):
            raise ValueError("unresolved seed: admit requests through with_seed()")
        t = sampling_tensors(params, device)
        t["seed"] = torch.tensor([p.seed for p in params], dtype=torch.long, device=device)
        return t

    def sample_next(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
    ) -> torch.Tensor:
        """A token per row from the target alone (first token after prefill). logits `[R, V]`,
        positions: the position each sampled token will occupy -> `[R]`."""
        t = self._params(params, logits.device)
        probs = logits_to_probs(logits, t["temperature"], t["top_k"], t["top_p"])
        pos = torch.as_tensor(list(positions), device=logits.device)
        return sample_from_probs(
            probs, exponential_noise(t["seed"], pos, probs.shape[-1], logits.device)
        )

    def draft_chooser(self, params: Sequence[SamplingParams], L: torch.Tensor):
        """How the proposer picks drafts. The draft of step `s` sits at position `L + s`."""
        if self.mode == "onehot":
            return lambda logits, step: (logits.argmax(-1), None)
        t = self._params(params, L.device)

        def choose(logits: torch.Tensor, step: int):
            q = logits_to_probs(logits, t["temperature"], t["top_k"], t["top_p"])  # [B, Dd]
            noise = exponential_noise(
                t["seed"], L + step, q.shape[-1], L.device, stream=STREAM_DRAFT
            )
            return sample_from_probs(q, noise), q

        return choose

    def verify(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        q: torch.Tensor | None,
        num_drafts: torch.Tensor,
        params: Sequence[SamplingParams],
        L: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits `[B, K+1, V]` of the verify forward over `[t_{L-1}, d_1..d_K]`; drafts
        `[B, K]` (target ids); q `[B, K, Dd]` or None; num_drafts `[B]`; L `[B]` committed
        lengths -> (emitted tokens `[B, K+1]` padded with -1, accepted counts `[B]`)."""
        B, K1, V = logits.shape
        K = K1 - 1
        dev = logits.device
        t = self._params(params, dev)
        live = torch.arange(K, device=dev)[None] < num_drafts[:, None]  # [B, K]
        cu = torch.zeros(B + 1, dtype=torch.long, device=dev)
        cu[1:] = torch.cumsum(num_drafts, 0)
        N = int(cu[-1])
        rep = lambda x: x.repeat_interleave(num_drafts)  # noqa: E731  per-request -> per-draft
        target_probs = logits_to_probs(
            logits[:, :K][live], rep(t["temperature"]), rep(t["top_k"]), rep(t["top_p"])
        )  # [N, V]
        # The bonus token sits right after the last draft: position L + n.
        bonus_logits = logits[torch.arange(B, device=dev), num_drafts]  # [B, V]
        bonus_probs = logits_to_probs(bonus_logits, t["temperature"], t["top_k"], t["top_p"])
        bonus = sample_from_probs(bonus_probs, exponential_noise(t["seed"], L + num_drafts, V, dev))
        draft_probs = None
        if q is not None:
            ids = torch.arange(q.shape[-1], device=dev) + self.drafter.d2t
            draft_probs = torch.zeros(N, V, device=dev)
            draft_probs[:, ids] = q[live].float()
        out, n_acc = rejection_sample(
            drafts[live].contiguous(),
            cu,
            draft_probs,
            target_probs.contiguous(),
            bonus,
            t["temperature"] == 0.0,
            uniforms_for(t["seed"], L, cu, N),
            exponential_noise(t["seed"], L, V, dev, stream=STREAM_RECOVERY),
            max_num_draft=K,
        )
        return out, n_acc
