"""Verification of one round: target probabilities, seeded randomness and the rejection
sampler, for a padded batch of requests, with static shapes and no host sync.

Modes:
- `onehot` (default): drafts are the drafter's argmax; q is one-hot, so a draft `d` is
  accepted with probability `p(d)` and the recovered token is drawn from `p` with `d`
  removed. Lossless for any deterministic draft choice.
- `full`: drafts are *sampled* from the drafter's own distribution q (temperature, top-k,
  top-p of the request) and verified with `min(1, p/q)`, recovering from `max(p - q, 0)`.

Randomness is keyed by (request seed, position of the token it decides, stream); which key
each draw reads is decided in one place, `draftinfer.decoding.sampling.RoundKeys` (DESIGN 3.12). Greedy requests (temperature 0) accept while the draft
equals the target argmax and emit the argmax at the first mismatch.

Static shapes: the padded drafts `[B, K]` (request b owns its first `num_drafts[b]`) are
scattered into the rejection sampler's ragged layout (`cu` offsets) inside a buffer of the
fixed size `B * K`, and every tensor is sized by `(B, K, V)` alone; the only data the host
needs (how many drafts were accepted) comes back with the engine's one readback per round.
"""

from __future__ import annotations

import torch
from draftkernels.rejection_sampler import rejection_sample

from draftinfer.decoding.proposer import greedy_chooser
from draftinfer.decoding.sampling import (
    RoundKeys,
    argmax_ids,
    exponential_noise,
    logits_to_probs,
    sample_from_probs,
    uniforms_for,
)

VERIFY_MODES = ("onehot", "full")


def _one_hot_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy target distribution: one-hot at the (lowest) argmax. `[R, V]` fp32."""
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter_(1, argmax_ids(logits)[:, None], 1.0)


class Verifier:
    def __init__(self, mode: str, vocab_size: int):
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify mode must be one of {VERIFY_MODES}, got {mode!r}")
        self.mode, self.vocab = mode, vocab_size

    def _placeholders(self, B: int, V: int, N: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
        key = (B, V, N, str(dev))
        if getattr(self, "_ph_key", None) != key:
            self._ph_key = key
            self._ph = (torch.ones(B, V, device=dev), torch.ones(N, device=dev))
        return self._ph

    def sample_next(
        self, logits: torch.Tensor, t: dict[str, torch.Tensor], positions: torch.Tensor
    ) -> torch.Tensor:
        """A token per row from the target alone (first token after prefill). logits `[R, V]`,
        sampling tensors `[R]`, positions `[R]`: where each sampled token will sit -> `[R]`."""
        probs = logits_to_probs(logits, t["temperature"], t["top_k"], t["top_p"])
        pos, stream = RoundKeys.sample(positions)
        noise = exponential_noise(t["seed"], pos, probs.shape[-1], logits.device, stream=stream)
        return sample_from_probs(probs, noise)

    def draft_chooser(self, t: dict[str, torch.Tensor], L: torch.Tensor):
        """How the proposer picks drafts; the draft of step `s` sits at position `L + s`."""
        if self.mode == "onehot":
            return greedy_chooser
        keys = RoundKeys(L)

        def choose(logits: torch.Tensor, step: int):
            q = logits_to_probs(logits, t["temperature"], t["top_k"], t["top_p"])  # [B, Dd]
            pos, stream = keys.draft(step)
            noise = exponential_noise(t["seed"], pos, q.shape[-1], L.device, stream=stream)
            return sample_from_probs(q, noise), q

        return choose

    def verify(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        q: torch.Tensor | None,
        draft_vocab_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        t: dict[str, torch.Tensor],
        L: torch.Tensor,
        all_greedy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accept drafts and emit one recovered or bonus token per request.

        logits `[B, K+1, V]` of the verify forward over `[t_{L-1}, d_1..d_K]`; drafts `[B, K]`
        (target ids); q `[B, K, Dd]` over the draft vocabulary whose target ids are
        `draft_vocab_ids [Dd]`, or None (one-hot); num_drafts `[B]`; sampling tensors `[B]`;
        L `[B]` committed lengths; `all_greedy` (a host fact) skips the sampling maths.
        -> (emitted tokens `[B, K+1]` padded with -1, accepted counts `[B]`).
        """
        B, K1, V = logits.shape
        K = K1 - 1
        dev = logits.device
        N = B * K  # static buffer size; request b's drafts go to rows cu[b]..cu[b+1]-1
        cu = torch.zeros(B + 1, dtype=torch.long, device=dev)
        cu[1:] = torch.cumsum(num_drafts, 0)
        j = torch.arange(K, device=dev)
        live = j[None] < num_drafts[:, None]  # [B, K]
        dst = torch.where(live, cu[:-1, None] + j[None], N).reshape(-1)  # [B*K], N = dump row

        def ragged(x: torch.Tensor) -> torch.Tensor:
            """Padded `[B*K, ...]` rows -> the ragged layout in a `[N, ...]` buffer."""
            out = torch.zeros((N + 1, *x.shape[1:]), dtype=x.dtype, device=dev)
            return out.index_copy_(0, dst, x)[:N]

        draft_logits = logits[:, :K].reshape(N, V)
        if all_greedy:
            target_probs = ragged(_one_hot_rows(draft_logits))
        else:
            rep = lambda x: x.repeat_interleave(K)  # noqa: E731  per-request -> per-draft row
            target_probs = ragged(
                logits_to_probs(
                    draft_logits, rep(t["temperature"]), rep(t["top_k"]), rep(t["top_p"])
                )
            )
        # The bonus token sits right after the last draft: position L + n.
        bonus_logits = logits[torch.arange(B, device=dev), num_drafts]  # [B, V]
        if all_greedy:
            bonus = argmax_ids(bonus_logits)
            # Greedy rows read no randomness: fixed placeholders, no hashing work per round.
            noise, uniforms = self._placeholders(B, V, N, dev)
        else:
            keys = RoundKeys(L)
            probs = logits_to_probs(bonus_logits, t["temperature"], t["top_k"], t["top_p"])
            pos, stream = keys.bonus(num_drafts)
            bonus = sample_from_probs(
                probs, exponential_noise(t["seed"], pos, V, dev, stream=stream)
            )
            pos, stream = keys.recovered()
            noise = exponential_noise(t["seed"], pos, V, dev, stream=stream)
            pos, stream = keys.accept()
            uniforms = uniforms_for(t["seed"], pos, cu, N, stream=stream)
        draft_probs = None
        if q is not None:
            full = torch.zeros(B * K, V, device=dev)
            full[:, draft_vocab_ids] = q.reshape(B * K, -1).float()
            draft_probs = ragged(full)
        return rejection_sample(
            ragged(drafts.reshape(-1)),
            cu,
            draft_probs,
            target_probs.contiguous(),
            bonus,
            t["is_greedy"],
            uniforms,
            noise,
            max_num_draft=K,
        )
