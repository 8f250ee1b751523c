"""Length-bucketed batch sampling and padding collation for tokenized conversations.

Terms:

- **example**: one tokenized conversation, `{"input_ids": [T_i], "loss_mask": [T_i]}`.
- **mega-chunk**: a run of `MEGA_CHUNK_BATCHES * batch_size` shuffled examples. Sorting by
  length happens *inside* a mega-chunk only, so batches are length-homogeneous (little
  padding) while the data order stays random at the scale of the epoch.
- **epoch order**: the list of batches (lists of example indices) for one pass; it is a pure
  function of `(seed, epoch)`, so a resumed run replays exactly the batches it would have seen.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Batches per mega-chunk: large enough that sorted batches have near-equal lengths, small
# enough that long and short conversations still mix across the epoch.
MEGA_CHUNK_BATCHES = 50


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int, shuffle: bool = True
) -> list[list[int]]:
    """Split `range(len(lengths))` into batches of at most `batch_size` indices.

    With `shuffle`: shuffle all indices, cut them into mega-chunks, sort each chunk by length
    (stable, so equal lengths keep their shuffled order), cut into batches and shuffle the
    batch order. Without it: the same bucketing over the indices in order, batches in order
    (deterministic evaluation with little padding). Every index appears exactly once; only
    the last batch of a mega-chunk can be short.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    # A string seed is hashed with SHA-512 by `random`, so the order does not depend on
    # PYTHONHASHSEED or on the platform.
    rng = random.Random(f"length_bucketed_batches:{seed}:{epoch}")
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    chunk = MEGA_CHUNK_BATCHES * batch_size
    batches: list[list[int]] = []
    for lo in range(0, len(order), chunk):
        bucket = sorted(order[lo : lo + chunk], key=lambda i: lengths[i])
        batches.extend(bucket[b : b + batch_size] for b in range(0, len(bucket), batch_size))
    if shuffle:
        rng.shuffle(batches)
    return batches


def held_out_config(cfg):
    """The `DataConfig` of the held-out split: `cfg.eval_split` of `cfg.eval_path` (default
    `cfg.path`), all of it (`max_samples` ignored)."""
    from dataclasses import replace

    return replace(cfg, path=cfg.eval_path or cfg.path, split=cfg.eval_split, max_samples=None)


def eval_batches(data, cfg, seed: int) -> list[list[int]]:
    """The first `cfg.eval_batches` length-bucketed batches of a tokenized held-out split, in
    order (what evaluation runs and what the offline feature cache stores for it)."""
    lengths = list(data["length"])
    return length_bucketed_batches(lengths, cfg.batch_size, seed, 0, shuffle=False)[
        : cfg.eval_batches
    ]


def held_out_batches(cfg, tokenizer, seed: int):
    """The held-out split (`held_out_config`) tokenized as text chat, and its evaluation
    batches (`eval_batches`). `cfg` is a `DataConfig`."""
    from drafttrain.data.chat import load_data, tokenize_dataset

    dcfg = held_out_config(cfg)
    data = tokenize_dataset(load_data(dcfg), tokenizer, dcfg)
    return data, eval_batches(data, cfg, seed)


@dataclass
class TokenizedSplit:
    """A tokenized split and the collate function of its rows.

    data: a `datasets.Dataset` with at least `input_ids`, `loss_mask` and `length` (a family
    may add columns); collate(rows, pad_id): the padded batch of dataset rows `rows`
    (`collate` below, plus the family's inputs); held_out(cfg, seed): the same adapter's
    held-out split and its evaluation batches."""

    data: Any
    collate: Callable[[list[int], int], dict[str, torch.Tensor]]
    held_out: Callable[[Any, int], tuple[TokenizedSplit, list[list[int]]]]
    # Batch keys whose first axis is not the batch row (a multimodal family's images), and
    # how the batch rows `rows [n]` (ascending) take theirs: shard_items(batch, rows) ->
    # {key: tensor} (`drafttrain.trainer.distributed.shard_batch`).
    item_keys: tuple[str, ...] = ()
    shard_items: Callable[[dict, torch.Tensor], dict[str, torch.Tensor]] | None = None


class ChatData:
    """The text family's data adapter: chat conversations through the tokenizer's template
    (`drafttrain.data.chat`), batches by `collate`. A family with other inputs (images)
    provides its own adapter with the same two calls."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def tokenize(self, cfg) -> TokenizedSplit:
        """The split `cfg` (a `DataConfig`) names, tokenized."""
        from drafttrain.data.chat import load_data, tokenize_dataset

        data = tokenize_dataset(load_data(cfg), self.tokenizer, cfg)
        return TokenizedSplit(
            data, lambda rows, pad_id: collate([data[i] for i in rows], pad_id), self.held_out
        )

    def held_out(self, cfg, seed: int) -> tuple[TokenizedSplit, list[list[int]]]:
        """The held-out split and its evaluation batches."""
        split = self.tokenize(held_out_config(cfg))
        return split, eval_batches(split.data, cfg, seed)


class BatchStream:
    """Deterministic micro-batch stream over a `TokenizedSplit`; its cursor (epoch, index) is
    what a checkpoint stores of the data. Each batch carries `index [B]`, its dataset rows (what
    a feature cache is read by)."""

    def __init__(self, split: TokenizedSplit, batch_size: int, pad_id: int, seed: int):
        self.split, self.pad_id, self.seed, self.batch_size = split, pad_id, seed, batch_size
        self.lengths = list(split.data["length"])
        self.epoch, self.index = 0, 0
        self._batches = length_bucketed_batches(self.lengths, batch_size, seed, 0)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, st: dict[str, int]) -> None:
        self.epoch, self.index = st["epoch"], st["index"]
        self._batches = length_bucketed_batches(
            self.lengths, self.batch_size, self.seed, self.epoch
        )

    def next(self) -> dict[str, torch.Tensor]:
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = length_bucketed_batches(
                self.lengths, self.batch_size, self.seed, self.epoch
            )
        ids = self._batches[self.index]
        self.index += 1
        batch = self.split.collate(ids, self.pad_id)
        batch["index"] = torch.tensor(ids, dtype=torch.long)  # [B] rows of the dataset
        return batch


def collate(examples: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad `examples` to the longest one (`T = max_i T_i`).

    Returns, all `torch.long` of shape `[B, T]`:
      - `input_ids`: token ids, `pad_id` at padding;
      - `attention_mask`: 1 for real tokens, 0 at padding;
      - `loss_mask`: the examples' loss masks, 0 at padding;
      - `position_ids`: `0 .. T_i - 1` for real tokens, 0 at padding.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    lengths = [len(ex["input_ids"]) for ex in examples]
    batch, width = len(examples), max(lengths)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    position_ids = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    for row, (ex, n) in enumerate(zip(examples, lengths)):
        if len(ex["loss_mask"]) != n:
            raise ValueError(
                f"example {row}: input_ids has {n} tokens, loss_mask {len(ex['loss_mask'])}"
            )
        input_ids[row, :n] = torch.as_tensor(ex["input_ids"], dtype=torch.long)
        loss_mask[row, :n] = torch.as_tensor(ex["loss_mask"], dtype=torch.long)
        attention_mask[row, :n] = 1
        position_ids[row, :n] = torch.arange(n)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
    }
