"""The drafter's input window (conventions 1 and 3), one definition for training and serving.

Drafter row `i` consumes token `t_{i+1}` with the target feature `f_i` at the target position
of token `i`: token-side inputs are *shifted* one row left, positions are not. For a
multimodal target the token side includes the input embedding: a row that consumes an image
placeholder gets the target's embedding of that slot (the vision embedding it scattered in),
not the drafter's text embedding of the placeholder id. `TokenEmbeds` carries those rows;
`token_embeddings` is the one place a drafter turns ids into input embeddings.

    mm = TokenEmbeds.of(target_output)          # None for text targets
    ids_k, mm_k = shift_left(ids, 1 + k), mm.shifted(1 + k) if mm else None
    x = token_embeddings(drafter.embed_tokens, ids_k, mm_k)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """Row i of the result is row i+n of x (dim 1); the last n rows are `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1) if n < x.shape[1] else torch.full_like(x, fill)


@dataclass
class TokenEmbeds:
    """Input embeddings that replace the drafter's own token embedding at some rows.

    mask `[B, T]` bool: rows whose consumed token is a multimodal placeholder;
    embeds `[B, T, H]`: the target's input embedding of that token (read only where `mask`)."""

    mask: torch.Tensor
    embeds: torch.Tensor

    @classmethod
    def of(cls, out) -> TokenEmbeds | None:
        """The unshifted window of a `TargetOutput` (slot `i` = token `i`), or None when the
        target scattered no multimodal embedding in (`mm_mask` None or all False is the same;
        None avoids the host sync of checking)."""
        if getattr(out, "mm_mask", None) is None:
            return None
        return cls(out.mm_mask, out.inputs_embeds)

    @classmethod
    def concat(cls, outs: list) -> TokenEmbeds | None:
        """The window of consecutive chunks' `TargetOutput`s along dim 1 (chunked prefill): None
        when no chunk had a multimodal slot."""
        if all(getattr(o, "mm_mask", None) is None for o in outs):
            return None
        masks = [
            o.mm_mask
            if o.mm_mask is not None
            else o.inputs_embeds.new_zeros(o.inputs_embeds.shape[:2], dtype=torch.bool)
            for o in outs
        ]
        return cls(torch.cat(masks, dim=1), torch.cat([o.inputs_embeds for o in outs], dim=1))

    def shifted(self, n: int) -> TokenEmbeds:
        """Row i gets row i+n (the token drafter row i consumes at shift n); tail rows False."""
        return TokenEmbeds(shift_left(self.mask, n, False), shift_left(self.embeds, n))

    def rows(self, index: slice | torch.Tensor) -> TokenEmbeds:
        """Columns `index` (dim 1) of every batch row."""
        return TokenEmbeds(self.mask[:, index], self.embeds[:, index])

    def batch(self, index: torch.Tensor) -> TokenEmbeds:
        """Batch rows `index` (dim 0)."""
        return TokenEmbeds(self.mask[index], self.embeds[index])


def token_embeddings(
    embedding: nn.Embedding, ids: torch.Tensor, mm: TokenEmbeds | None
) -> torch.Tensor:
    """`embedding(ids)` `[B, T, H]`, with the target's embeddings at `mm.mask` rows."""
    x = embedding(ids)
    if mm is None:
        return x
    return torch.where(mm.mask[..., None], mm.embeds.to(x.dtype), x)
