"""Training config of the parallel-drafting kind (`drafter: ptd` in the config tree)."""

from __future__ import annotations

from dataclasses import dataclass

from drafttrain.jobs.config import above, at_least
from drafttrain.jobs.errors import ConfigError
from drafttrain.kinds.eagle3.config import Eagle3TrainConfig


@dataclass
class PTDTrainConfig(Eagle3TrainConfig):
    """Parallel drafting (P-EAGLE / PTD): K drafts from one forward via mask slots. The TTT
    fields it inherits (`ttt_steps`, `ttt_decay`) are unused by its objective."""

    kind: str = "ptd"
    num_layers: int = 2
    # Drafts per forward (depths 0..K-1) the drafter is trained for.
    parallel_k: int = 4
    # Mask token: a reserved id of the target vocabulary; null = the tokenizer's pad token
    # (else the last id).
    mask_token_id: int | None = None
    # Conditional drop-token sampling: an anchor keeps its depth-d slot with probability
    # keep_ratio given it kept depth d-1 (so ~keep_ratio^d overall), but every depth keeps at
    # least keep_floor of the anchors; max_slots_per_seq caps the slots of one sequence.
    keep_ratio: float = 0.7
    keep_floor: float = 0.1
    max_slots_per_seq: int = 1024
    # Loss weight of depth d: depth_decay^d.
    depth_decay: float = 0.8

    def check(self) -> None:
        super().check()
        at_least("drafter", self, 1, "parallel_k", "max_slots_per_seq")
        above("drafter", self, 0, "depth_decay", "keep_ratio")
        for name in ("keep_ratio", "keep_floor"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"drafter.{name} must be in [0, 1], got {getattr(self, name)!r}")
