"""A static (preallocated) KV cache addressed by (cache row, position), gpt-fast style.

Every query slot carries its position; its key/value are written at `[row, position]` and
it attends to indices `0..position` of its row. Slots with position -1 are padding: they
write nothing and their outputs are garbage the caller ignores.

Why no explicit rollback is ever needed: a round writes positions from the committed length
on, and every later query at position p only reads indices <= p. Entries a rejected draft
left past the committed length are therefore overwritten (by the next round's writes, which
start at the committed length and proceed in order) before any query can see them.
Conventions 6 and 7 follow from the same rule: the mask is rebuilt from positions at every
call, so no sequence-length state can go stale between draft steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftinfer.drafters.layers import expand_kv


class StaticKVCache:
    """Per-layer K/V tensors `[max_batch, max_seq_len, n_kv, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        max_seq_len: int,
        n_kv: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ):
        shape = (max_batch, max_seq_len, n_kv, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_seq_len = max_seq_len

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """q `[B, T, nh, D]`, k/v `[B, T, nkv, D]`, positions `[B, T]` (-1 = padding),
        rows `[B]` -> `[B, T, nh, D]`."""
        B, T = positions.shape
        valid = positions >= 0
        if int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(positions.max())} >= cache length {self.max_seq_len}")
        r = rows[:, None].expand(B, T)[valid]
        p = positions[valid]
        self.k[layer][r, p] = k[valid].to(self.k[layer].dtype)
        self.v[layer][r, p] = v[valid].to(self.v[layer].dtype)
        S = max(int(positions.max()) + 1, 1)  # all-padding calls still attend to index 0
        nh = q.shape[2]
        K = expand_kv(self.k[layer][rows, :S], nh).transpose(1, 2)  # [B, nh, S, D]
        V = expand_kv(self.v[layer][rows, :S], nh).transpose(1, 2)
        idx = torch.arange(S, device=positions.device)
        mask = idx[None, None, :] <= positions[:, :, None]  # [B, T, S]
        mask[..., 0] |= ~valid  # padding slots see index 0 so softmax stays finite
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), K.to(q.dtype), V.to(q.dtype), attn_mask=mask[:, None]
        )
        return o.transpose(1, 2)

    def bind(self, positions: torch.Tensor, rows: torch.Tensor):
        """An `attn_fn(layer, q, k, v)` for one forward over these slots."""

        def attn_fn(layer: int, q, k, v):
            return self.attend(layer, q, k, v, positions, rows)

        return attn_fn
