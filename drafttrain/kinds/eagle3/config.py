"""Training config of the EAGLE-3 kind (`drafter: eagle3` in the config tree)."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafttrain.jobs.config import DrafterTrainConfig


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
