"""Training config of the EAGLE-3 kind (`drafter: eagle3` in the config tree)."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafttrain.jobs.config import DrafterTrainConfig, above, at_least
from drafttrain.jobs.errors import ConfigError


@dataclass
class Eagle3TrainConfig(DrafterTrainConfig):
    kind: str = "eagle3"
    # Target decoder layers whose *inputs* are tapped (DESIGN 3.2). Empty: (2, L//2, L-3).
    aux_layer_ids: list[int] = field(default_factory=list)
    draft_vocab_size: int = 32000
    norm_before_residual: bool = False
    # Training-time test: number of unrolled draft steps and per-step loss weight decay^k.
    ttt_steps: int = 7
    ttt_decay: float = 0.8

    def check(self) -> None:
        super().check()
        at_least("drafter", self, 1, "draft_vocab_size", "ttt_steps")
        above("drafter", self, 0, "ttt_decay")
        bad = [j for j in self.aux_layer_ids if j < 0]
        if bad:
            raise ConfigError(f"drafter.aux_layer_ids must be >= 0, got {bad}")
