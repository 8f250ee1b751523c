"""Per-draft-position loss weights, as pure functions (any objective whose rows are a sequence
of draft positions per anchor: a block's slots, a TTT chain's steps, a parallel rollout).

Positions are the last axis; position 0 here is the *first drafted* position (a block's slot
1). Nothing here depends on a drafter kind.

- `exp_decay_weights`: the fixed decay of DFlash (arXiv 2602.06036): `w_k = exp(-k / gamma)`
  for drafted position k = 0, 1, ... (slot k + 1 of a block, `exp(-(slot - 1) / gamma)`),
  gamma 7 for blocks of 16, 5 for 10, 4 for 8.
- `dpace_weights`: D-PACE (arXiv 2605.18810; SpecForge `_dpace_weight`, speculators
  `dpace_loss_decay`): from the draft's (detached) probability `p_k` of the target token,
  smoothed `s_k = (1 - alpha) p_k + alpha` (1 at invalid positions), the prefix products
  `P_k = prod_{j <= k} s_j` (the chance the draft survives to k) and the weight
  `w_k = sum_{j >= k} P_j m_j`: the expected number of accepted tokens position k still
  influences. Variants: `cumulative` (`w = P`) and `continuation` (`w = suffix / P`).
"""

from __future__ import annotations

import torch

DPACE_VARIANTS = ("dpace", "cumulative", "continuation")


def exp_decay_weights(
    num_positions: int, gamma: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """`[num_positions]` fp32: `exp(-k / gamma)`, k = 0 .. num_positions - 1."""
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    return torch.exp(-torch.arange(num_positions, dtype=torch.float32, device=device) / gamma)


@torch.no_grad()
def dpace_weights(
    prob: torch.Tensor,  # [..., K] the draft's probability of the target token, per position
    valid: torch.Tensor,  # [..., K] bool: positions that are scored
    alpha: float = 0.5,
    variant: str = "dpace",
) -> torch.Tensor:
    """D-PACE weights `[..., K]` fp32, detached (module docstring). Invalid positions are a
    factor 1 in the prefix products and excluded from the suffix sums; the caller still
    masks them."""
    if variant not in DPACE_VARIANTS:
        raise ValueError(f"D-PACE variant must be one of {DPACE_VARIANTS}, got {variant!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"D-PACE alpha must be in [0, 1], got {alpha}")
    m = valid.float()
    smooth = torch.where(valid, (1.0 - alpha) * prob.float() + alpha, torch.ones_like(m))
    prefix = torch.cumprod(smooth, dim=-1)
    if variant == "cumulative":
        return prefix
    suffix = torch.flip(torch.cumsum(torch.flip(prefix * m, dims=[-1]), dim=-1), dims=[-1])
    if variant == "continuation":
        return suffix / prefix.clamp_min(torch.finfo(prefix.dtype).tiny)
    return suffix
