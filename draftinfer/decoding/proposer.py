"""Proposers: turn a drafter into K drafts per request per round (DESIGN 2.1 seam 4).

Lifecycle, called by the engine (and the reference loop):

- `admit(first_pass) -> pending`: requests were admitted to cache rows `first_pass.rows` and
  their prompts prefilled; `first_pass` holds the drafter rows the prefill made final (row `i`
  consumes `(t_{i+1}, f_i)` at position `pos_i`, convention 1), *left*-padded: every
  request's last row sits in the last column, padding (`cache_pos` -1) before its first. The
  proposer builds whatever state it keeps (its KV cache, a re-prefill cache) and returns the
  rows it wants in the next round's first pass (e.g. the last column, whose output yields
  draft 1), the same number for every request.
- `propose(first_pass, num_drafts, k, choose, attn_len) -> (drafts, q)`: one round's drafting
  for a padded batch. `first_pass` is what the last commit made final (the accepted drafts and
  the recovered / bonus token, with the *target's* features from the verify forward), so
  writing it refreshes the drafter state at committed positions (convention 6).
- `release(row)`: the request left `row`; reset any per-request state the proposer keeps.

Shapes (padded batch of `B` requests, `T` first-pass rows each):
`FirstPass.rows [B]`, `ids [B, T]`, `features [B, T, F]` (the target features named by the
drafter's `FeatureSpec`, raw), `cache_pos [B, T]` (-1 = padding), `rope_pos [B, T]` or
`[3, B, T]`; `num_drafts [B]` caps each request's drafts (near `max_model_len` or
`max_tokens`); drafts `[B, k]` target ids (0 past a request's cap); q `[B, k, Dd]` over the
proposer's draft vocabulary (`draft_vocab_ids()`), zeros past the cap, or None.

`propose` does no host sync when `attn_len` is given: shapes depend only on (B, T, k).

Confidence (`draftinfer.decoding.confidence`): after `propose`, `confidences()` is the last
round's per-draft confidence `[B, k]` fp32 (None unless `track_confidence` is on and the kind
gives none): a kind's own (`self.confidence`, e.g. DSpark's head) or, for every other kind,
the derived one that `_record` / `_record_all` keep while `track_confidence` is on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from draftinfer.conventions.window import TokenEmbeds
from draftinfer.decoding.compiled import compiled
from draftinfer.decoding.confidence import derived_confidence
from draftinfer.decoding.sampling import argmax_ids
from draftinfer.files.errors import CheckpointError
from draftinfer.models.layers import causal_attention

# choose(draft_logits [B, Dd], step) -> (draft ids in the draft vocabulary [B],
#                                        q over the draft vocabulary [B, Dd] or None)
DraftChooser = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


class GreedyChooser:
    """The greedy `DraftChooser`: the argmax of the draft logits, no q. `all` picks every
    step of `[B, k, Dd]` logits in one pass (what `Proposer._record_all` calls for drafters
    that have all k logits at once); a chooser without `all` is called step by step."""

    def __call__(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, None]:
        return self.all(logits)

    def all(self, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        return argmax_ids(logits), None


greedy_chooser = GreedyChooser()


def greedy_record(
    drafts: torch.Tensor,  # [B, >= start + n] target ids, written in place
    start: int,
    logits: torch.Tensor,  # [B, n, Dd]
    live: torch.Tensor,  # [B, n]
    vocab_ids: torch.Tensor,  # [Dd] target id of each draft-vocabulary id
) -> None:
    """Greedy drafts `start .. start + n - 1`: the argmax of each step's logits as a target
    id, 0 past a request's cap. What `Proposer._record` does with `greedy_chooser`, as one
    piece that `Proposer.compile` compiles (eagerly the argmax's two passes, the id lookup,
    the where and the copy are eight small kernels a step)."""
    n = logits.shape[1]
    drafts[:, start : start + n] = torch.where(live, vocab_ids[argmax_ids(logits)], 0)


def causal_attn(_layer, q, k, v):
    """No-cache causal attention over the whole sequence (reference drafting)."""
    return causal_attention(q, k, v)


@dataclass
class FirstPass:
    rows: torch.Tensor  # [B]
    ids: torch.Tensor  # [B, T]
    features: torch.Tensor  # [B, T, F]
    cache_pos: torch.Tensor  # [B, T], -1 = padding
    rope_pos: torch.Tensor  # [B, T] or [3, B, T]
    # Rows consuming a multimodal placeholder: the target's input embedding of that token
    # (prompt rows of a multimodal target only; drafts and committed tokens are text).
    mm: TokenEmbeds | None = None

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(rows, ids, features, cache_pos, rope_pos): a round's first pass as plain tensors
        (the engine's round state; a round's first pass never carries `mm`)."""
        if self.mm is not None:
            raise ValueError("a round's first pass carries no multimodal rows (prefill only)")
        return self.rows, self.ids, self.features, self.cache_pos, self.rope_pos

    @classmethod
    def of_tensors(cls, tensors) -> FirstPass:
        return cls(*tensors)

    def take(self, start: int, stop: int | None = None) -> FirstPass:
        """Rows `start:stop` of every request."""
        s = slice(start, stop)
        return FirstPass(
            self.rows,
            self.ids[:, s],
            self.features[:, s],
            self.cache_pos[:, s],
            self.rope_pos[..., s],
            None if self.mm is None else self.mm.rows(s),
        )


def last_valid(cache_pos: torch.Tensor) -> torch.Tensor:
    """Index of each request's last live first-pass row `[B]` (0 when it has none); live rows
    are a prefix of every request's first pass."""
    return ((cache_pos >= 0).sum(1) - 1).clamp(min=0)


class Proposer:
    """What every proposer shares: the drafter, the check that the drafter's kind drafts this
    way (S8), the lifecycle defaults and recording the K drafts (and q) step by step."""

    mode: ClassVar[str] = ""

    def __init__(
        self, drafter, max_batch: int, max_seq_len: int, device: torch.device, dtype: torch.dtype
    ):
        from draftinfer.registry import spec_of

        spec = spec_of(drafter)
        if spec.proposer_class is not type(self):
            raise CheckpointError(
                f"a {spec.name!r} drafter drafts by {spec.mode}; it cannot run in {self.mode} mode"
            )
        self.drafter, self.max_batch, self.max_seq_len = drafter, max_batch, max_seq_len
        self.device, self.dtype = torch.device(device), dtype
        self.vocab_ids = drafter.draft_vocab_ids().to(self.device)  # [Dd] target ids
        self._greedy = greedy_record
        # A kind's own per-draft confidence of the last round `[B, k]` (None: the kind has
        # none); the engine turns `track_confidence` on to get the derived one otherwise.
        self.confidence: torch.Tensor | None = None
        self.track_confidence = False
        self._derived: torch.Tensor | None = None  # [B, k] fp32, the last round's

    # -- lifecycle ----------------------------------------------------------------------------
    def admit(self, first_pass: FirstPass, attn_len: int | None = None) -> FirstPass:
        raise NotImplementedError

    def propose(
        self,
        first_pass: FirstPass,
        num_drafts: torch.Tensor,
        k: int,
        choose: DraftChooser = greedy_chooser,
        attn_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def release(self, row: int) -> None:
        """Stateless between requests by default: KV rows are overwritten before they are read."""

    def weights_updated(self) -> None:
        """The drafter's weights were replaced in place (`draftinfer.decoding.swap`): refresh
        what was derived from them, in place (a captured graph keeps reading the same
        tensors). Here the draft-to-target id map (`d2t` is a weight of its own-vocabulary
        drafters); a kind that derives more extends this."""
        self.vocab_ids.copy_(self.drafter.draft_vocab_ids())

    # -- shared pieces ------------------------------------------------------------------------
    def has_own_confidence(self) -> bool:
        """Whether this proposer sets `self.confidence` itself each round (a learned head);
        then no derived confidence is computed beside it. False here."""
        return False

    def confidences(self) -> torch.Tensor | None:
        """The last round's per-draft confidence `[B, k]` fp32 (module docstring): the kind's
        own where it has one, else the derived one (kept while `track_confidence` is on)."""
        return self.confidence if self.confidence is not None else self._derived

    def _keep_derived(self, drafts: torch.Tensor, start: int, logits: torch.Tensor) -> None:
        """Derived confidence of drafts `start .. start + n - 1` from their logits `[B, n, Dd]`
        (only while tracking, and only for a kind without its own). A fresh `[B, k]` buffer at
        step 0: no state across rounds."""
        if not self.track_confidence or self.has_own_confidence():
            return
        if start == 0:
            self._derived = torch.zeros(drafts.shape, dtype=torch.float32, device=drafts.device)
        n = logits.shape[1]
        self._derived[:, start : start + n] = derived_confidence(logits)

    def draft_vocab_ids(self) -> torch.Tensor:
        """Target id of each draft-vocabulary id `[Dd]` (what q's last axis indexes)."""
        return self.vocab_ids

    def kv_snapshot(self, row: int, n: int) -> list[torch.Tensor]:
        """The drafter state at cache indices `0..n-1` of `row`, for the KV-refresh test (S2)."""
        raise NotImplementedError

    def compile(self, **kwargs) -> None:
        """Compile the drafter forward(s) from outside the model code (STYLE rule 3); here the
        greedy choice of drafts (`greedy_record`). A kind that compiles more calls this too."""
        self._greedy = compiled(greedy_record, **kwargs)

    def _record(
        self,
        drafts: torch.Tensor,
        qs: torch.Tensor | None,
        step: int,
        logits: torch.Tensor,
        live: torch.Tensor,
        choose: DraftChooser,
    ):
        """Pick draft `step` from logits `[B, Dd]`; requests past their cap (`live` False)
        get 0 and q = 0. Returns the (lazily allocated) q buffer `[B, k, Dd]` or None."""
        if choose is greedy_chooser:
            self._greedy(drafts, step, logits[:, None], live[:, None], self.vocab_ids)
            self._keep_derived(drafts, step, logits[:, None])
            return qs
        choice, q = choose(logits, step)
        drafts[:, step] = torch.where(live, self.vocab_ids[choice], 0)
        self._keep_derived(drafts, step, logits[:, None])
        if q is not None:
            if qs is None:
                qs = torch.zeros(*drafts.shape, q.shape[-1], dtype=q.dtype, device=q.device)
            qs[:, step] = q * live[:, None]
        return qs

    def _record_all(
        self, drafts: torch.Tensor, logits: torch.Tensor, live: torch.Tensor, choose: DraftChooser
    ) -> torch.Tensor | None:
        """`_record` for every step of logits `[B, k, Dd]` (live `[B, k]`): one call where the
        chooser picks all steps at once (`GreedyChooser.all`: one argmax over `[B, k, Dd]`
        instead of k), else step by step. Returns q `[B, k, Dd]` or None."""
        k = logits.shape[1]
        if choose is greedy_chooser:
            self._greedy(drafts, 0, logits, live, self.vocab_ids)
            self._keep_derived(drafts, 0, logits)
            return None
        pick_all = getattr(choose, "all", None)
        if pick_all is None:
            qs = None
            for step in range(k):
                qs = self._record(drafts, qs, step, logits[:, step], live[:, step], choose)
            return qs
        choice, q = pick_all(logits)
        drafts[:, :k] = torch.where(live, self.vocab_ids[choice], 0)
        self._keep_derived(drafts, 0, logits)
        return None if q is None else q * live[..., None]

    @staticmethod
    def reference_drafts(
        drafter,
        ids: torch.Tensor,
        features: torch.Tensor,
        rope_pos: torch.Tensor,
        n: int,
        choose: DraftChooser,
        mm: TokenEmbeds | None = None,
    ) -> tuple[list[int], list]:
        """No-cache reference for one request: rows `[R]` (ids, raw target features `[R, F]`,
        RoPE positions `[R]` / `[3, R]`, and `mm`: the target's input embeddings of the rows
        whose consumed token is a multimodal placeholder, mask `[R]`, embeds `[R, H]`, or
        None) -> n drafts (target ids) and their q (or None each), recomputing the drafter
        from scratch for every step."""
        raise NotImplementedError
