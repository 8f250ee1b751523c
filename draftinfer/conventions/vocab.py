"""The draft vocabulary mapping (DESIGN convention 8), defined once for training and inference.

- `V`: target vocabulary size; `Dd`: draft vocabulary size (`Dd <= V`).
- draft id `i` in `[0, Dd)`: a row of the drafter's `lm_head`.
- `d2t`: `LongTensor[Dd]`, an *offset* per draft id: target id = `i + d2t[i]` (offsets, not
  ids, because that is what vLLM and SGLang read).
- `t2d`: `BoolTensor[V]`, `t2d[v]` is True iff target id `v` has a draft id.

Draft logits map back to the full vocabulary with `-inf` elsewhere, so a softmax gives exactly
zero probability to tokens the drafter cannot propose (rejection sampling sees the true q).
"""

from __future__ import annotations

import torch


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: `[Dd]` int64, `i + d2t[i]`."""
    return torch.arange(d2t.shape[0], device=d2t.device, dtype=torch.long) + d2t.long()


def identity_maps(vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the draft vocabulary `0..Dd-1` (until a data-built one is loaded)."""
    d2t = torch.zeros(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    return d2t, t2d


def map_draft_logits_to_target(
    logits: torch.Tensor, d2t: torch.Tensor, target_vocab_size: int
) -> torch.Tensor:
    """Scatter draft logits `[..., Dd]` into target-vocab logits `[..., V]`, `-inf` elsewhere."""
    if logits.shape[-1] != d2t.shape[0]:
        raise ValueError(f"logits last dim {logits.shape[-1]} != draft vocab size {d2t.shape[0]}")
    ids = draft_to_target_ids(d2t).to(logits.device)  # [Dd]
    out = logits.new_full((*logits.shape[:-1], target_vocab_size), float("-inf"))  # [..., V]
    out[..., ids] = logits
    return out


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> str | None:
    """Why (d2t, t2d) is not a valid draft vocabulary of a `vocab_size` target, or None."""
    ids = draft_to_target_ids(d2t)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return f"d2t maps outside the target vocabulary [0, {vocab_size})"
    if t2d.shape != (vocab_size,):
        return f"t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},)"
    if int(t2d.sum()) != ids.numel() or (ids.numel() > 0 and not bool(t2d[ids].all())):
        return "t2d does not mark exactly the target ids of d2t"
    return None
