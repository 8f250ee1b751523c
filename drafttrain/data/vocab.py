"""The draft vocabulary: a subset of the target vocabulary that the drafter's `lm_head` covers.

Terms (DESIGN section 3 item 8; the EAGLE-3 layout vLLM and SGLang load):

- `V`: target vocabulary size; `Dd`: draft vocabulary size (`Dd <= V`).
- **draft id** `i` in `[0, Dd)`: a row of the drafter's `lm_head`.
- `d2t`: `LongTensor[Dd]`, an **offset** per draft id: target id = `i + d2t[i]`.
  (Offsets, not ids, because that is what the serving engines read.)
- `t2d`: `BoolTensor[V]`, `t2d[v]` is True iff target id `v` has a draft id.

The chosen target ids are the `Dd` most frequent tokens among **loss-masked** tokens only
(what the drafter must predict; a token frequent only in prompts is useless to draft), ties
broken by smaller id. If fewer than `Dd` distinct tokens occur, the smallest unused ids fill
the rest. Chosen ids are sorted ascending, so draft id order follows target id order and
`d2t` is non-decreasing.

The mapping itself (`draft_to_target_ids`, `map_draft_logits_to_target`) is defined once, in
`draftinfer.conventions.vocab`; this module only builds it from data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from draftinfer.conventions.vocab import draft_to_target_ids, map_draft_logits_to_target
from drafttrain.jobs.errors import DataError
from drafttrain.trainer.shards import write_atomic

__all__ = [
    "build_draft_vocab",
    "count_masked_tokens",
    "draft_to_target_ids",
    "draft_vocab_from_counts",
    "load_or_build_draft_vocab",
    "map_draft_logits_to_target",
]

# Bumped when the selection rule changes, so stale cache files are not reused.
_VOCAB_RULE_VERSION = 1
# Rows are concatenated up to this many tokens before one bincount (memory vs. call overhead).
_FLUSH_TOKENS = 1 << 20


# --------------------------------------------------------------------------- building


def _check_sizes(target_vocab_size: int, draft_vocab_size: int) -> None:
    if draft_vocab_size < 1:
        raise DataError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    if draft_vocab_size > target_vocab_size:
        raise DataError(
            f"draft_vocab_size {draft_vocab_size} exceeds the target vocab size {target_vocab_size}"
        )


def _add_counts(counts: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """counts[v] += number of positions with ids == v and mask != 0. ids, mask: `[N]`."""
    if ids.shape != mask.shape:
        raise DataError(f"token list has {ids.numel()} tokens but its loss mask has {mask.numel()}")
    picked = ids[mask != 0]
    if picked.numel() == 0:
        return
    lo, hi = int(picked.min()), int(picked.max())
    if lo < 0 or hi >= counts.numel():
        bad = hi if hi >= counts.numel() else lo
        raise DataError(f"token id {bad} is outside the target vocab [0, {counts.numel()})")
    counts += torch.bincount(picked, minlength=counts.numel())


def count_masked_tokens(
    token_lists: Iterable[Sequence[int]],
    loss_masks: Iterable[Sequence[int]],
    target_vocab_size: int,
) -> torch.Tensor:
    """Frequency of every target id over loss-masked positions: `[V]` long."""
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    ids_buf: list[torch.Tensor] = []
    mask_buf: list[torch.Tensor] = []
    pending = 0
    for ids, mask in zip(token_lists, loss_masks, strict=True):
        ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask)
        if ids_t.shape != mask_t.shape:
            raise DataError(
                f"token list has {ids_t.numel()} tokens but its loss mask has {mask_t.numel()}"
            )
        ids_buf.append(ids_t.reshape(-1))
        mask_buf.append(mask_t.reshape(-1))
        pending += ids_t.numel()
        if pending >= _FLUSH_TOKENS:
            _add_counts(counts, torch.cat(ids_buf), torch.cat(mask_buf))
            ids_buf, mask_buf, pending = [], [], 0
    if ids_buf:
        _add_counts(counts, torch.cat(ids_buf), torch.cat(mask_buf))
    return counts


def draft_vocab_from_counts(
    counts: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d2t [Dd] long, t2d [V] bool)` from token frequencies `counts [V]` (rule in module doc)."""
    target_vocab_size = counts.numel()
    _check_sizes(target_vocab_size, draft_vocab_size)
    # Stable sort on -count orders by frequency descending, then by id ascending; the
    # zero-count ids come last in id order, which is exactly the "fill with the smallest
    # unused ids" rule when fewer than Dd distinct tokens occur.
    order = torch.sort(-counts.long(), stable=True).indices  # [V]
    chosen = torch.sort(order[:draft_vocab_size]).values  # [Dd], ascending target ids
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.long)  # [Dd] offsets
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)  # [V]
    t2d[chosen] = True
    return d2t, t2d


def build_draft_vocab(
    token_lists: Iterable[Sequence[int]],
    loss_masks: Iterable[Sequence[int]],
    target_vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d2t [Dd] long, t2d [V] bool)` from tokenized rows and their loss masks."""
    _check_sizes(target_vocab_size, draft_vocab_size)
    counts = count_masked_tokens(token_lists, loss_masks, target_vocab_size)
    return draft_vocab_from_counts(counts, draft_vocab_size)


# --------------------------------------------------------------------------- caching


def _count_dataset(dataset: Any, target_vocab_size: int) -> torch.Tensor:
    """Token counts `[V]` of a tokenized `datasets.Dataset`, read as Arrow batches (no per-token Python)."""
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for table in dataset.with_format("arrow").iter(batch_size=8192):
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        # torch.tensor copies: Arrow buffers are read-only.
        _add_counts(counts, torch.tensor(ids, dtype=torch.long), torch.tensor(mask))
    return counts


def _dataset_key(dataset: Any, target_vocab_size: int, draft_vocab_size: int) -> str:
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint is None:
        # Not a datasets.Dataset (or an in-memory one without a fingerprint): hash the content.
        h = hashlib.sha256()
        for row in dataset:
            h.update(json.dumps([list(row["input_ids"]), list(row["loss_mask"])]).encode())
        fingerprint = h.hexdigest()
    payload = json.dumps(
        {
            "fingerprint": fingerprint,
            "target_vocab_size": target_vocab_size,
            "draft_vocab_size": draft_vocab_size,
            "rule_version": _VOCAB_RULE_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _cache_file(cache_path: str, key: str) -> str:
    # A path ending in .safetensors is the file itself; anything else is a cache directory.
    if cache_path.endswith(".safetensors"):
        return cache_path
    return os.path.join(cache_path, f"draft_vocab_{key}.safetensors")


def _read_cache(path: str, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    from safetensors import safe_open

    if not os.path.isfile(path):
        return None
    with safe_open(path, framework="pt") as f:
        if (f.metadata() or {}).get("key") != key:
            return None
        return f.get_tensor("d2t"), f.get_tensor("t2d")


def load_or_build_draft_vocab(
    tokenized_dataset: Any,
    target_vocab_size: int,
    draft_vocab_size: int,
    cache_path: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d2t [Dd] long, t2d [V] bool)` for a tokenized dataset, cached in a safetensors file.

    `cache_path`: a directory (file `draft_vocab_<key>.safetensors` inside it), a path ending
    in `.safetensors`, or None (no caching). `<key>` hashes the dataset fingerprint and both
    sizes and is also stored in the file's metadata; a file with another key is rebuilt.
    `tokenized_dataset` is a `datasets.Dataset` (or any iterable of rows) with `input_ids`
    and `loss_mask`.
    """
    from safetensors.torch import save

    _check_sizes(target_vocab_size, draft_vocab_size)
    key = path = None
    if cache_path is not None:
        key = _dataset_key(tokenized_dataset, target_vocab_size, draft_vocab_size)
        path = _cache_file(cache_path, key)
        cached = _read_cache(path, key)
        if cached is not None:
            return cached

    if hasattr(tokenized_dataset, "with_format"):
        counts = _count_dataset(tokenized_dataset, target_vocab_size)
    else:
        rows = list(tokenized_dataset)
        counts = count_masked_tokens(
            [r["input_ids"] for r in rows], [r["loss_mask"] for r in rows], target_vocab_size
        )
    d2t, t2d = draft_vocab_from_counts(counts, draft_vocab_size)

    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        metadata = {
            "key": key,
            "target_vocab_size": str(target_vocab_size),
            "draft_vocab_size": str(draft_vocab_size),
        }
        # Atomic (a per-process temp file, renamed): a concurrent reader (another rank) never
        # sees a partial file.
        write_atomic(Path(path), save({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, metadata))
    return d2t, t2d
