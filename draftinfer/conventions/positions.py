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


def block_positions(last_positions: torch.Tensor, n: int) -> torch.Tensor:
    """RoPE positions of a block drafter's `n` slots `[..., n]` from the position of the last
    row the drafter has as context (`[...]`, or `[3, ...]` for M-RoPE): the anchor (slot 0, the
    last committed token) sits one past it and slot s at the anchor's + s, on every axis
    (convention 13). It is the runner's decode rule (Qwen3-VL: `cache_pos + mrope_delta` on
    all three axes, since the anchor and the drafts are text tokens whose predecessor is
    text); slot s is where a chain drafter's draft step `1 + s` of that row sits
    (`draft_step_positions`). The block drafter's training (`drafttrain.kinds.dflash`) and its
    proposer and reference loop call this one function.
    """
    if n < 1:
        raise ValueError(f"a block has >= 1 slot, got {n}")
    steps = torch.arange(1, n + 1, device=last_positions.device)
    return last_positions[..., None] + steps  # a new tensor, never an in-place update
