"""Which keys a block slot sees (convention 13): one predicate for training (eager and flex),
the runner's KV cache and the reference loop.

Vocabulary: a *block* is `[anchor, MASK x (n - 1)]`; the anchor is the last committed token
at token index `a`, slot `s` of its block sits at token index `a + s` (RoPE: the anchor's
position + s). *Context* rows are the target features of committed tokens, one per token
index `j`; they enter every drafter layer as keys/values only.

A query (token index `q`, its block's anchor `qa`) sees
- context row `j` iff `j < qa`: strictly before the anchor (the anchor's own target feature
  does not exist yet when the block is drafted);
- a block key of the *same* block (`ka == qa`) at index `k`: all of them (bidirectional), or
  `k <= q` in a causal layer (JetSpec's `causal_block`, or a sliding-window layer);
- in a sliding-window layer only keys with `q - k < window` (measured from the query's own
  index, as the trainers and vLLM measure it).
Keys of other blocks are never visible (`ka` differs), nor stale cache entries (`ka = STALE`).
"""

from __future__ import annotations

import torch

CONTEXT = -1  # `k_anchor` of a context row
STALE = -2  # `k_anchor` of a cache entry that is neither context nor the current block
PAD = 1 << 30  # anchor/index of a padding block in training (no real query sees it)
NO_WINDOW = 1 << 30  # a window no index distance reaches (`mask_flags`)


def visible(
    q_index: torch.Tensor,
    q_anchor: torch.Tensor,
    k_index: torch.Tensor,
    k_anchor: torch.Tensor,
    causal: bool | torch.Tensor,
    window: int | None | torch.Tensor,
) -> torch.Tensor:
    """Bool, broadcast over the inputs' shapes: may the query see the key (module docstring).

    `causal` and `window` are Python values (a bool; an int or None), or 0-d tensors (bool;
    int, `NO_WINDOW` for none) inside a flex `mask_mod`: there a Python value read from the
    closure is a constant of the compiled `create_block_mask` graph, and on CUDA (torch 2.11)
    that graph was reused for a layer with another (causal, window), silently dropping the
    causal or window part (tests/kinds/test_dflash_train.py, the CUDA flex test)."""
    ctx = (k_anchor == CONTEXT) & (k_index < q_anchor)
    same = k_anchor == q_anchor
    if isinstance(causal, torch.Tensor):
        same = same & ((k_index <= q_index) | ~causal)
    elif causal:
        same = same & (k_index <= q_index)
    ok = ctx | same
    if window is not None:
        ok = ok & (q_index - k_index < window)
    return ok


def mask_flags(causal: bool, window: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal, window) as the 0-d tensors `visible` takes inside a flex `mask_mod`."""
    w = NO_WINDOW if window is None else window
    return torch.tensor(causal, device=device), torch.tensor(w, device=device)


def nonempty(mask: torch.Tensor) -> torch.Tensor:
    """A padding query row that sees nothing sees key 0 instead (finite garbage, never NaN)."""
    empty = ~mask.any(-1, keepdim=True)
    first = torch.zeros_like(mask)
    first[..., 0] = True
    return mask | (empty & first)
