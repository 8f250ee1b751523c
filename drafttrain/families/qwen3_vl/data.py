"""Image+text chat for vision-language targets (Qwen3-VL): tokenization with assistant-only
loss masks through the processor, and collation of the pixel inputs.

Terms (see `drafttrain.data.chat` for the text ones):

- **rendered text** `F`: the processor's chat template applied to the conversation; every
  image is one placeholder (`<|image_pad|>` inside `<|vision_start|>...<|vision_end|>`).
- **expanded text** `F'`: `F` with the k-th placeholder repeated `n_k = t*h*w / merge**2`
  times (the image's token count), which is what the processor tokenizes. Character `c` of
  `F` sits at `c + sum over placeholders k ending at or before c of (n_k - 1) * len(placeholder)`
  in `F'`.
- **loss mask**: the assistant spans of `F` (the text rule of `drafttrain.data.chat`, the
  template rendered by the processor), moved to `F'`, then 1 for every token whose offsets
  overlap one. So the mask is found on the model's own template (the real Qwen3-VL one has no
  `{% generation %}` markers) and the token ids are the processor's own.
- **image run**: the consecutive image-token slots of one image (`mm_token_type_ids == 1`).
  Truncation to `max_length` never cuts a run: a cut inside one moves back to its start, and
  only the images whose runs are kept are fed (their grids are stored per row).

Pixel values are not stored: each tokenized row keeps its source row (`source_row`) and the
image grids, and the collate function decodes the row's images and runs the image processor
again (the datasets cache stays the size of the token ids; a grid that differs from the
stored one is a `DataError`).

A batch of a VL split (`VLChatData.tokenize(cfg).collate(rows, pad_id)`) holds the text
batch (`drafttrain.data.batching.collate`) plus
- `mm_token_type_ids` `[B, T]` long: 0 text, 1 image (0 at padding);
- with at least one image: `pixel_values` `[sum(t*h*w), D]` (images in row-major order),
  `image_grid_thw` `[n_images, 3]` and `image_rows` `[n_images]` (the batch row of each
  image; `shard_images` splits a batch by it, for `drafttrain.trainer.distributed.shard_batch`).
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import torch

from draftinfer.evaluation.chat import data_base_dir, row_messages
from draftinfer.families.qwen3_vl.processor import conversation_images, encode_conversation
from drafttrain.data.batching import TokenizedSplit, collate, eval_batches, held_out_config
from drafttrain.data.chat import assistant_spans, end_of_turn_marker, load_data
from drafttrain.jobs.config import DataConfig
from drafttrain.jobs.errors import ConfigError, DataError


def image_runs(types: list[int]) -> list[tuple[int, int]]:
    """`[start, end)` slot ranges of the image runs (`types` = mm_token_type_ids)."""
    runs, start = [], None
    for i, t in enumerate([*types, 0]):
        if t == 1 and start is None:
            start = i
        elif t != 1 and start is not None:
            runs.append((start, i))
            start = None
    return runs


def truncate_at_image_boundary(types: list[int], max_length: int) -> int:
    """The number of slots kept: `max_length`, moved back to the start of an image run that
    it would cut."""
    cut = min(len(types), max_length)
    for start, end in image_runs(types):
        if start < cut < end:
            return start
    return cut


def expanded_spans(
    text: str, spans: list[tuple[int, int]], placeholder: str, counts: list[int]
) -> list[tuple[int, int]]:
    """`spans` of the rendered text moved to the expanded text (module docstring): the k-th
    `placeholder` occurrence becomes `counts[k]` copies of it."""
    ends, at = [], 0
    for _ in counts:
        at = text.find(placeholder, at)
        if at < 0:
            raise DataError(
                f"the rendered text has fewer {placeholder!r} placeholders than images "
                f"({len(ends)} < {len(counts)})"
            )
        at += len(placeholder)
        ends.append(at)
    if text.find(placeholder, at) >= 0:
        raise DataError(f"the rendered text has more {placeholder!r} placeholders than images")
    # gained[k] = characters added by the first k expansions.
    gained = [0]
    for n in counts:
        gained.append(gained[-1] + (n - 1) * len(placeholder))

    def move(c: int) -> int:
        return c + gained[bisect.bisect_right(ends, c)]

    return [(move(a), move(b)) for a, b in spans]


def tokenize_vl_conversation(
    processor: Any,
    messages: list[dict[str, Any]],
    max_length: int,
    *,
    base_dir: Path | None,
    sample: str,
    end_marker: str | None = None,
) -> dict[str, Any]:
    """One image+text conversation: `input_ids`, `loss_mask`, `mm_token_type_ids` (each
    `[T]`, `T <= max_length`, no image run cut) and `image_grid_thw` (`[n_kept_images, 3]`
    as lists)."""
    from draftinfer.families.qwen3_vl.processor import render_conversation

    enc = encode_conversation(
        processor,
        messages,
        add_generation_prompt=False,
        base_dir=base_dir,
        sample=sample,
        offsets=True,
    )

    def render(msgs, add_generation_prompt):
        return render_conversation(processor, msgs, add_generation_prompt)

    try:
        text, spans = assistant_spans(processor, messages, end_marker, render=render)
    except DataError as e:
        raise DataError(f"{sample}: {e}") from None
    if text != enc.text:  # both are the processor's template over the same messages
        raise DataError(f"{sample}: the chat template renders differently on a second call")
    grids = enc.image_grid_thw.tolist() if enc.image_grid_thw is not None else []
    merge = int(processor.image_processor.merge_size)
    counts = [t * h * w // merge**2 for t, h, w in grids]
    try:
        moved = expanded_spans(text, spans, enc.image_token, counts)
    except DataError as e:
        raise DataError(f"{sample}: {e}") from None
    runs = image_runs(enc.mm_token_type_ids)
    if [b - a for a, b in runs] != counts:
        raise DataError(
            f"{sample}: image token runs {[b - a for a, b in runs]} do not match the images' "
            f"token counts {counts}"
        )
    width = max([b for _, b in enc.offsets] + [b for _, b in moved] + [0])
    in_span = bytearray(width + 1)
    for a, b in moved:
        in_span[a:b] = b"\x01" * (b - a)
    mask = [
        1 if t == 0 and any(in_span[a : max(b, a + 1)]) else 0
        for (a, b), t in zip(enc.offsets, enc.mm_token_type_ids)
    ]
    keep = truncate_at_image_boundary(enc.mm_token_type_ids, max_length)
    kept_images = sum(1 for _, end in runs if end <= keep)
    return {
        "input_ids": enc.input_ids[:keep],
        "loss_mask": mask[:keep],
        "mm_token_type_ids": enc.mm_token_type_ids[:keep],
        "image_grid_thw": grids[:kept_images],
    }


def _tokenize_row(
    row: dict[str, Any],
    index: int,
    processor: Any,
    field: str,
    max_length: int,
    end_marker: str,
    base_dir: Path | None,
    where: str,
) -> dict[str, Any]:
    messages = row_messages(row, field)
    out = tokenize_vl_conversation(
        processor,
        messages,
        max_length,
        base_dir=base_dir,
        sample=f"{where} row {index}",
        end_marker=end_marker,
    )
    out["length"] = len(out["input_ids"])
    out["num_assistant_turns"] = sum(1 for m in messages if m["role"] == "assistant")
    out["num_loss_tokens"] = sum(out["loss_mask"])
    out["source_row"] = index
    return out


def _features():
    from datasets import Features, Sequence, Value

    ints = Sequence(Value("int64"))
    return Features(
        {
            "input_ids": ints,
            "loss_mask": ints,
            "mm_token_type_ids": ints,
            "image_grid_thw": Sequence(ints),
            "length": Value("int64"),
            "num_assistant_turns": Value("int64"),
            "num_loss_tokens": Value("int64"),
            "source_row": Value("int64"),
        }
    )


class VLChatData:
    """The Qwen3-VL family's data adapter: image+text chat through the target's processor
    (`draftinfer.families.qwen3_vl.processor.load_processor`)."""

    def __init__(self, processor):
        self.processor = processor

    def tokenize(self, cfg: DataConfig) -> TokenizedSplit:
        """The split `cfg` names: columns `input_ids`, `loss_mask`, `mm_token_type_ids`,
        `image_grid_thw`, `length`, `source_row`; rows without loss tokens dropped. A bad
        image fails the whole split with a one-line `DataError` naming its row (nothing is
        cached for a split that failed)."""
        source = load_data(cfg)
        field = cfg.messages_field
        base_dir = data_base_dir(cfg.path)
        where = f"{cfg.path} split {cfg.split}"
        end_marker = end_of_turn_marker(self.processor)
        tokenized = source.map(
            _tokenize_row,
            with_indices=True,
            fn_kwargs={
                "processor": self.processor,
                "field": field,
                "max_length": cfg.max_length,
                "end_marker": end_marker,
                "base_dir": base_dir,
                "where": where,
            },
            remove_columns=source.column_names,
            features=_features(),
            num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
            desc="tokenizing image+text conversations",
        )
        if len(tokenized) == 0 or sum(tokenized["num_assistant_turns"]) == 0:
            raise DataError(f"dataset {cfg.path!r} has no assistant turns to train on")
        if sum(tokenized["num_loss_tokens"]) == 0:
            raise DataError(
                f"dataset {cfg.path!r} has no assistant tokens within "
                f"data.max_length={cfg.max_length}"
            )
        kept = tokenized.filter(
            lambda n: n > 0, input_columns="num_loss_tokens", desc="dropping rows without loss"
        ).remove_columns(["num_assistant_turns", "num_loss_tokens"])
        collate = Collator(self.processor, kept, source, field, base_dir, where)
        return TokenizedSplit(kept, collate, self.held_out, PER_IMAGE + PER_PATCH, shard_images)

    def held_out(self, cfg: DataConfig, seed: int) -> tuple[TokenizedSplit, list[list[int]]]:
        split = self.tokenize(held_out_config(cfg))
        return split, eval_batches(split.data, cfg, seed)


class Collator:
    """`(rows, pad_id) -> batch` of a tokenized VL split (module docstring)."""

    def __init__(self, processor, data, source, field: str, base_dir: Path | None, where: str):
        self.processor, self.data, self.source = processor, data, source
        self.field, self.base_dir, self.where = field, base_dir, where

    def pixels(self, row: dict[str, Any]) -> torch.Tensor:
        """`[sum(t*h*w), D]` pixel values of a tokenized row's kept images."""
        grids = row["image_grid_thw"]
        index = row["source_row"]
        sample = f"{self.where} row {index}"
        messages = row_messages(self.source[index], self.field)
        images = conversation_images(messages, self.base_dir, sample)[: len(grids)]
        out = self.processor.image_processor(images=images, return_tensors="pt")
        if out["image_grid_thw"].tolist() != grids:
            raise DataError(
                f"{sample}: its images now give grids {out['image_grid_thw'].tolist()}, "
                f"tokenized with {grids} (images changed since the data was tokenized?)"
            )
        return out["pixel_values"]

    def __call__(self, rows: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        examples = [self.data[i] for i in rows]
        batch = collate(examples, pad_id)
        types = torch.zeros_like(batch["input_ids"])  # [B, T]
        pixels, grids, owners = [], [], []
        for b, ex in enumerate(examples):
            types[b, : len(ex["mm_token_type_ids"])] = torch.as_tensor(ex["mm_token_type_ids"])
            if ex["image_grid_thw"]:
                pixels.append(self.pixels(ex))
                grids.extend(ex["image_grid_thw"])
                owners.extend([b] * len(ex["image_grid_thw"]))
        batch["mm_token_type_ids"] = types
        if grids:
            batch["pixel_values"] = torch.cat(pixels)  # [sum(t*h*w), D]
            batch["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)  # [n_images, 3]
            batch["image_rows"] = torch.tensor(owners, dtype=torch.long)  # [n_images]
        return batch


# Batch keys whose first axis is not the batch row :
# per image, and per image patch. `image_rows [n_images]` names each image's batch row, and
# image k owns `prod(image_grid_thw[k])` consecutive rows of `pixel_values`.
PER_IMAGE = ("image_grid_thw", "image_rows")
PER_PATCH = ("pixel_values",)


def shard_images(batch: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """The image keys of the rows `idx` (ascending), `image_rows` renumbered to the shard's
    rows; images and patches keep their order (row-major, as the target consumes them)."""
    present = [k for k in PER_IMAGE + PER_PATCH if k in batch]
    missing = [k for k in PER_IMAGE + PER_PATCH if k not in batch]
    if missing:
        raise ConfigError(
            f"cannot shard a batch with {present} but without {missing}: images must name "
            "their batch rows (image_rows) and grids (image_grid_thw)"
        )
    owner = batch["image_rows"]  # [n_images]
    keep = torch.isin(owner, idx)  # [n_images]
    patches = batch["image_grid_thw"].prod(-1)  # [n_images]
    keep_patch = keep.repeat_interleave(patches)  # [sum(t*h*w)]
    if keep_patch.numel() != batch["pixel_values"].shape[0]:
        raise ConfigError(
            f"pixel_values has {batch['pixel_values'].shape[0]} rows, the image grids "
            f"{int(patches.sum())} patches"
        )
    new_row = torch.full_like(owner, -1)
    new_row[keep] = torch.searchsorted(idx, owner[keep])
    if not keep.any():
        return {}  # a shard without images gets no image keys (a text batch)
    return {
        "image_grid_thw": batch["image_grid_thw"][keep],
        "image_rows": new_row[keep],
        "pixel_values": batch["pixel_values"][keep_patch],
    }
