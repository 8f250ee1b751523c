"""The target's distribution for training, computed where it is needed and only over the
vocabulary an objective scores: never a full-vocabulary fp32 `[B, T, V]` tensor.

A training target (`FrozenTarget.batch_output`, `drafttrain.cache.CachedTarget`) hands the
objective a `TrainTargetOutput` whose `logits` are *not* computed: it carries `head`, a
`HeadLogits` = the target's final hidden state `[B, T, H]` and its head (`TargetHead`: the
output embedding `[V, H]`, plus the final norm when the hidden state is the pre-norm one).
Any other `TargetOutput` (the runner's native target in tests) carries dense `logits`.
Objectives ask one function for what they score, whichever they got:

    dist = target_distribution(tgt, vocab_ids)   # vocab_ids [Dv] target ids, or None (all)

`TargetDist` (flat rows `n = b * T + t`):
- `probs [B*T, Dv]`: the target's softmax restricted to `vocab_ids` and renormalized (the soft
  labels); fp32 for an fp32 target, bf16 for a lower-precision one (the logits and the softmax
  are fp32 either way, only the stored table is rounded);
- `top1 [B*T]` int64: the argmax over `vocab_ids` (an index into them), from the fp32 logits;
- `in_vocab [B*T]` bool: the target's own top-1 over the *whole* vocabulary lies in `vocab_ids`.

Both are computed chunk by chunk over rows under `no_grad`: one chunk's logits `[c, V]`
(`CHUNK_ELEMENTS` values) exist at a time, in the head's dtype (a bf16 matmul for a bf16
target) and then fp32, exactly the numbers the target's own forward gives row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftinfer.models.target import TargetOutput
from drafttrain.jobs.errors import TargetError

# Logit values materialized at once: rows per chunk = CHUNK_ELEMENTS // V (512 rows of a
# 128k vocabulary, 256 MiB in fp32).
CHUNK_ELEMENTS = 1 << 26


class TargetHead:
    """The target's own final norm (for a pre-norm input) and output embedding.

    `logits = lm_head(norm(h))` for a pre-norm `h`, `lm_head(h)` for a post-norm one, in the
    target's dtype (then fp32), with the target's logit soft-capping if its config has one:
    the computation of the target's forward after its last decoder layer. It keeps only these
    two modules, so the rest of a target can be freed (the feature cache)."""

    def __init__(
        self,
        weight: torch.Tensor,
        norm: torch.nn.Module | None = None,
        softcap: float | None = None,
    ):
        self.weight = weight  # [V, H]
        self.norm = norm  # applied first: the head input is the pre-norm final hidden state
        self.softcap = softcap
        self.kind = "post_norm" if norm is None else "pre_norm"

    @classmethod
    def of(cls, target, kind: str) -> TargetHead:
        """The head of a `FrozenTarget` for a `pre_norm` or `post_norm` input."""
        if kind not in ("pre_norm", "post_norm"):
            raise TargetError(f"head input must be pre_norm or post_norm, got {kind!r}")
        lm_head = target.model.get_output_embeddings()
        if getattr(lm_head, "bias", None) is not None:
            raise TargetError(f"target {target.info.architecture}: its output embedding has a bias")
        if kind == "pre_norm" and target.final_norm is None:
            raise TargetError(f"target {target.info.architecture} has no final `norm`")
        norm = target.final_norm if kind == "pre_norm" else None
        return cls(lm_head.weight, norm, getattr(target.config, "final_logit_softcapping", None))

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h `[..., H]` -> logits `[..., V]` in the head's dtype."""
        h = h.to(self.weight.dtype)
        if self.norm is not None:
            h = self.norm(h)
        z = F.linear(h, self.weight)
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h `[B, T, H]` -> logits `[B, T, V]` fp32 (all at once: tests, the cache check)."""
        return self.head_logits(h).float()


@dataclass
class HeadLogits:
    """The logits of a batch, not computed: the target's final hidden state and its head."""

    hidden: torch.Tensor  # [B, T, H]: the head's input (pre- or post-norm, as `head.kind`)
    head: TargetHead

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.hidden.shape[:2])

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Logits of flat rows `lo:hi` `[hi - lo, V]` in the head's dtype."""
        return self.head.head_logits(self.hidden.flatten(0, 1)[lo:hi])

    def dense(self) -> torch.Tensor:
        """All logits `[B, T, V]` fp32 (tests only: what the target's forward returns)."""
        return self.head.logits(self.hidden)


@dataclass
class DenseLogits:
    """Logits a target already computed `[B, T, V]` (the runner's native target)."""

    logits: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.logits.shape[:2])

    @property
    def vocab_size(self) -> int:
        return int(self.logits.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self.logits.dtype

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        return self.logits.flatten(0, 1)[lo:hi]

    def dense(self) -> torch.Tensor:
        return self.logits.float()


@dataclass
class TrainTargetOutput(TargetOutput):
    """A `TargetOutput` whose logits are left to `head` (`logits` is None)."""

    head: HeadLogits | None = None


def logit_source(tgt: TargetOutput) -> HeadLogits | DenseLogits:
    """Where `tgt`'s logits come from: its head, or the dense logits it carries."""
    head = getattr(tgt, "head", None)
    return head if head is not None else DenseLogits(tgt.logits)


def target_logits(tgt: TargetOutput) -> torch.Tensor:
    """All logits `[B, T, V]` fp32 of any target output (tests and diagnostics only)."""
    return logit_source(tgt).dense()


@dataclass
class TargetDist:
    """What an objective scores against, per flat row `b * T + t` (module docstring)."""

    probs: torch.Tensor  # [B*T, Dv]
    top1: torch.Tensor  # [B*T] int64, index into the vocabulary subset
    in_vocab: torch.Tensor  # [B*T] bool
    shape: tuple[int, int]  # (B, T)


def probs_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The soft labels of an fp32 target stay fp32; a bf16 / fp16 target's are stored in bf16."""
    return torch.float32 if logits_dtype == torch.float32 else torch.bfloat16


@torch.no_grad()
def target_distribution(
    tgt: TargetOutput, vocab_ids: torch.Tensor | None = None, temperature: float = 1.0
) -> TargetDist:
    """The target's distribution over `vocab_ids [Dv]` (ascending target ids, e.g. a drafter's
    `draft_vocab_ids()`; None: the whole vocabulary) for every row of `tgt` (module docstring),
    at `temperature` (a distillation temperature: `softmax(z / T)`; `top1` is the same)."""
    src = logit_source(tgt)
    B, T = src.shape
    V, N = src.vocab_size, B * T
    dev = (src.hidden if isinstance(src, HeadLogits) else src.logits).device
    member = None
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(dev)
        member = torch.zeros(V, dtype=torch.bool, device=dev)
        member[vocab_ids] = True
    Dv = V if vocab_ids is None else int(vocab_ids.numel())
    probs = torch.empty(N, Dv, dtype=probs_dtype(src.dtype), device=dev)
    top1 = torch.empty(N, dtype=torch.long, device=dev)
    in_vocab = torch.ones(N, dtype=torch.bool, device=dev)
    step = max(1, CHUNK_ELEMENTS // V)
    for lo in range(0, N, step):
        hi = min(N, lo + step)
        # Logits in the head's dtype; no fp32 copy of the full-vocabulary chunk: argmax and
        # softmax read them as they are (the softmax computes in fp32), so the numbers are
        # those of the fp32 logits.
        z = src.rows(lo, hi)  # [c, V]
        if member is not None:
            in_vocab[lo:hi] = member[z.argmax(-1)]
            z = z.index_select(-1, vocab_ids)  # [c, Dv]
        top1[lo:hi] = z.argmax(-1)
        if temperature != 1.0:
            z = z.float() / temperature
        probs[lo:hi] = torch.softmax(z, dim=-1, dtype=torch.float32)
    return TargetDist(probs, top1, in_vocab, (B, T))
