"""`Slots`: where each query token of a forward lives, with the KV-cache index and the RoPE
position kept apart (DESIGN 2.1 seam 3).

A forward runs over a padded batch of query *slots* `[B, T]`:

- `rows [B]`: the cache row of each batch row (a request owns one row while it is admitted);
- `cache_pos [B, T]` int64: the KV-cache index slot `(b, t)` writes and the causal bound it
  reads up to (it sees cache indices `0..cache_pos`); `-1` marks a *padding slot*: it writes
  into the scratch column, nobody reads it and its outputs are finite garbage;
- `rope_pos [B, T]` or `[3, B, T]` (M-RoPE): what rotary embeddings read, nothing else;
  None asks the target to derive it from the cache index (`target.rope_positions`: text
  targets `cache_pos`, Qwen3-VL `cache_pos + mrope_delta[row]` on all three axes). A prefill
  takes it from the target's `prefill_plan` (Qwen3-VL: its `get_rope_index` table; text: None);
- `attn_len`: how many cache indices every row reads (`0..attn_len-1`). A fixed or bucketed
  value keeps attention shapes static, so a new sequence length is not a new kernel shape and
  the forward needs no host sync. None means "max(cache_pos) + 1", found with one host sync
  (prefill and tests only).

KV caches read only `cache_pos`; rotary embeddings read only `rope_pos`. For text targets the
two coincide at live slots, for M-RoPE targets they differ by the request's `mrope_delta`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Slots:
    rows: torch.Tensor  # [B] int64
    cache_pos: torch.Tensor  # [B, T] int64, -1 = padding
    rope_pos: torch.Tensor | None = None  # [B, T] or [3, B, T] int64
    attn_len: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.cache_pos.shape)  # (B, T)

    def with_rope(self, rope_pos: torch.Tensor) -> Slots:
        return Slots(self.rows, self.cache_pos, rope_pos, self.attn_len)


def text_rope(cache_pos: torch.Tensor) -> torch.Tensor:
    """RoPE positions of a text target: the cache index (padding slots at 0). `[B, T]`."""
    return cache_pos.clamp(min=0)


def attn_bucket(needed: int, cap: int, floor: int = 64) -> int:
    """The attention length to read for `needed` keys: the next power of two >= `needed`
    (at least `floor`), at most `cap` (the cache length). Few distinct values, so compiled
    forwards and attention kernels see few shapes as sequences grow."""
    if needed > cap:
        raise ValueError(f"{needed} keys do not fit a cache of {cap} positions")
    size = max(floor, 1 << max(needed - 1, 0).bit_length())
    return min(size, cap)


def max_live_position(cache_pos: torch.Tensor) -> int:
    """Largest live cache index (one host sync), -1 when every slot is padding."""
    if cache_pos.numel() == 0:
        return -1
    return int(cache_pos.max())
