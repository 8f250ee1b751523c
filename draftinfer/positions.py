"""Position rules shared by training and the runner (DESIGN 3.1, 3.3, 3.4).

Positions are always tensors: 1-D `[N]` (or batched `[B, T]`) for text targets, `[3, ...]`
for M-RoPE. Nothing here mutates its input: the target's position buffer is never reused
for the drafter.
"""

from __future__ import annotations

import torch


def draft_step_positions(base_positions: torch.Tensor, step: int) -> torch.Tensor:
    """Positions of draft step `step` (0 = the first pass over target features).

    Drafter row `i` consumes `(t_{i+1}, f_i)` at the target position of token `i`
    (`base_positions[..., i]`, convention 1). At training-time-test step `k` that row has
    already consumed `k` of its own outputs, so it sits at `pos_i + k`: exactly the position
    the runner gives the k-th chained draft (convention 4). For M-RoPE `[3, ...]` inputs all
    three axes advance together, as decode steps do (convention 3).
    """
    if step < 0:
        raise ValueError(f"draft step must be >= 0, got {step}")
    return base_positions + step  # a new tensor, never an in-place update
