"""`CachedTarget`: training's target when `data.cache=DIR` is set. It answers the call the
training loop makes of a target, `batch_output(batch, features) -> TargetOutput`, by reading
rows `batch["index"]` from the cache and right-padding them to the batch's `T`; the target
itself is never run.

What it returns, against `FrozenTarget.forward` on the same batch:
- `features`: the requested segments, decoded into the target's dtype (bit-equal to the
  live target's for a float32 cache of an fp32 target, or a bfloat16 cache of a bf16 target);
- `logits`: not computed; `head` carries the stored head input and the target's own head
  (`drafttrain.frozen.head.TargetHead`), from which objectives compute the distribution they
  score (`target_distribution`), chunk by chunk;
- `rope_pos`: the stored RoPE positions, 0 at padding (as the live target's);
- `inputs_embeds`: `[B, T, 0]`. No objective reads it (they build their own token
  embeddings), so the cache does not store it; the empty last axis makes any future use
  fail on its shape instead of reading zeros.

Opening checks everything before training writes anything: the manifest against the config
(a one-line `ConfigError` naming the first mismatching field), the drafter's features against
the stored ones, completeness, and every shard's size and sha256 (a one-line `DataError`
naming the shard file).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from draftinfer.models.target import FeatureSpec, TargetOutput
from drafttrain.cache.emitted import is_emitted
from drafttrain.cache.fingerprint import common_fingerprint, split_fingerprint
from drafttrain.cache.format import FORMAT, STORAGE, Layout, decode, mismatch
from drafttrain.frozen.head import HeadLogits, TargetHead, TrainTargetOutput
from drafttrain.jobs.config import TrainConfig
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.trainer.shards import ShardedOutput

OPEN_SHARDS = 64  # safetensors handles kept open (each an mmap)


class _Split:
    """Row lookup over one split's shards: dataset row -> (shard, first token, length)."""

    def __init__(self, root: Path, entries: list[dict[str, Any]]):
        self.paths = [root / e["file"] for e in entries]
        shard, start, length, rows = [], [], [], []
        for i, path in enumerate(self.paths):
            with _open(path) as f:
                offsets = f.get_tensor("offsets").numpy()
                r = f.get_tensor("rows").numpy()
            shard.append(np.full(len(r), i))
            start.append(offsets[:-1])
            length.append(np.diff(offsets))
            rows.append(r)
        rows_all = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        size = int(rows_all.max()) + 1 if len(rows_all) else 0
        self.shard = np.full(size, -1, dtype=np.int64)
        self.start = np.zeros(size, dtype=np.int64)
        self.length = np.zeros(size, dtype=np.int64)
        if len(rows_all):
            self.shard[rows_all] = np.concatenate(shard)
            self.start[rows_all] = np.concatenate(start)
            self.length[rows_all] = np.concatenate(length)
        self._handles: OrderedDict[int, Any] = OrderedDict()

    def handle(self, i: int):
        if i in self._handles:
            self._handles.move_to_end(i)
            return self._handles[i]
        h = _open(self.paths[i])
        self._handles[i] = h
        if len(self._handles) > OPEN_SHARDS:
            self._handles.popitem(last=False)
        return h

    def locate(self, row: int) -> tuple[int, int, int]:
        if not 0 <= row < len(self.shard) or self.shard[row] < 0:
            raise DataError(f"dataset row {row} is not in the feature cache")
        return int(self.shard[row]), int(self.start[row]), int(self.length[row])


def _open_splits(root: Path, m: dict[str, Any], names: list[str], verify: bool, key: str):
    """The `_Split` of each of `names`, after checking the output is complete and its files
    are there with their sizes (and, `verify`, sha256)."""
    splits = {}
    output = ShardedOutput(root, FORMAT, m)
    for split in names:
        entries = [e for e in output.shards if e["split"] == split]
        planned = m["splits"][split]["num_shards"]
        if not output.complete or len(entries) != planned:
            raise DataError(
                f"{key}={root} is incomplete ({len(entries)} of {planned} {split} "
                "shards written): write it again with the same settings"
            )
        output.check(entries, verify)  # every file there, size (and sha256)
        splits[split] = _Split(root, entries)
    return splits


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DataError(f"corrupted feature-cache shard {path}: {first}") from None


class CachedTarget:
    """A feature cache standing in for the frozen target of training (module docstring)."""

    def __init__(self, root: Path, layout: Layout, head: TargetHead, splits, split: str, dtype):
        self.root, self.layout, self.head = root, layout, head
        self._splits: dict[str, _Split] = splits
        self.split = split
        self.dtype = dtype  # the target's dtype: what the live target's features come in

    @classmethod
    def open(
        cls,
        cfg: TrainConfig,
        target,
        tokenizer,
        data,
        features: FeatureSpec,
    ) -> CachedTarget:
        """Check the cache at `cfg.data.cache` against the config, the target (a loaded
        `FrozenTarget`, of which only the final norm and output embedding are kept), the
        tokenized training `data`, the rows held-out evaluation will run (`data.eval_split`)
        and the drafter's `features`."""
        from drafttrain.data import held_out_batches

        root = Path(cfg.data.cache)
        m = FORMAT.read(root)
        if m is None:
            raise DataError(f"data.cache={root} is not a feature cache: no manifest.json there")
        if is_emitted(m):
            raise ConfigError(
                f"data.cache={root} holds samples the runner emitted: read it with data.emitted"
            )
        layout = Layout.from_dict(m["layout"])
        layout.columns(features, f"data.cache={root}")  # all the drafter consumes is stored
        if layout.hidden_size != target.info.hidden_size:
            raise ConfigError(
                f"data.cache={root} holds hidden size {layout.hidden_size}, the target has "
                f"{target.info.hidden_size}"
            )
        want = common_fingerprint(cfg, tokenizer, target)
        wanted = {"train": (data, list(range(len(data))))}
        if cfg.data.eval_split:
            if "eval" not in m["splits"]:
                raise ConfigError(
                    f"data.cache={root} has no eval split but data.eval_split="
                    f"{cfg.data.eval_split!r}: write the cache with it, or set data.eval_split=null"
                )
            eval_data, batches = held_out_batches(cfg.data, tokenizer, cfg.seed)
            wanted["eval"] = (eval_data, sorted({i for b in batches for i in b}))
        for split, (ds, rows) in wanted.items():
            want.update(split_fingerprint(cfg, split, ds, rows))
        have = dict(m["fingerprint"])
        for split in wanted:
            have.update(m["splits"][split]["fingerprint"])
        bad = mismatch(want, have)
        if bad:
            raise ConfigError(f"data.cache={root} was written for another config: {bad}")
        splits = _open_splits(root, m, list(wanted), cfg.cache.verify, "data.cache")
        head = TargetHead.of(target, layout.head_input)
        return cls(root, layout, head, splits, "train", target.model.dtype)

    @classmethod
    def open_emitted(cls, cfg: TrainConfig, target, features: FeatureSpec) -> CachedTarget:
        """The runner-emitted samples at `cfg.data.emitted` (`drafttrain.cache.emitted`), checked
        against the target (the one the runner ran: same `target.name_or_path`) and the drafter's
        `features`. Its training split is `tokenized_split()`: the samples carry their tokens."""
        root = Path(cfg.data.emitted)
        m = FORMAT.read(root)
        if m is None:
            raise DataError(f"data.emitted={root} holds no emitted samples: no manifest.json there")
        if not is_emitted(m):
            raise ConfigError(
                f"data.emitted={root} is an offline feature cache: read it with data.cache"
            )
        layout = Layout.from_dict(m["layout"])
        layout.columns(features, f"data.emitted={root}")
        if layout.hidden_size != target.info.hidden_size:
            raise ConfigError(
                f"data.emitted={root} holds hidden size {layout.hidden_size}, the target has "
                f"{target.info.hidden_size}"
            )
        have = m["fingerprint"]["target.name_or_path"]
        if have != cfg.target.name_or_path:
            raise ConfigError(
                f"data.emitted={root} was decoded by target {have!r}, training's target is "
                f"{cfg.target.name_or_path!r}"
            )
        splits = _open_splits(root, m, ["train"], cfg.cache.verify, "data.emitted")
        head = TargetHead.of(target, layout.head_input)
        return cls(root, layout, head, splits, "train", target.model.dtype)

    def tokenized_split(self):
        """The training split the stored tokens make (emitted samples only): a
        `TokenizedSplit` over `input_ids`, `loss_mask`, `length`, dataset row i = cached row i,
        batched by the text collate."""
        from datasets import Dataset

        from drafttrain.data.batching import TokenizedSplit, collate

        sp = self._splits["train"]
        n = len(sp.shard)
        cols: dict[str, list] = {"input_ids": [None] * n, "loss_mask": [None] * n}
        for row in range(n):
            shard, start, length = sp.locate(row)
            f = sp.handle(shard)
            for k in cols:
                if k not in f.keys():
                    raise DataError(f"{sp.paths[shard]} holds no {k}: not runner-emitted samples")
                cols[k][row] = f.get_slice(k)[start : start + length].tolist()
        data = Dataset.from_dict({**cols, "length": [len(x) for x in cols["input_ids"]]})

        def held_out(cfg, seed):
            raise ConfigError("data.emitted holds no held-out split: set data.eval_split=null")

        return TokenizedSplit(
            data, lambda rows, pad: collate([data[i] for i in rows], pad), held_out
        )

    def for_split(self, split: str) -> CachedTarget:
        """The same cache answering the rows of `split` ("train" or "eval")."""
        if split not in self._splits:
            raise ConfigError(f"the feature cache {self.root} has no {split} split")
        return CachedTarget(self.root, self.layout, self.head, self._splits, split, self.dtype)

    def read_rows(self, rows: list[int], T: int) -> dict[str, torch.Tensor]:
        """Rows right-padded to `T`: hidden `[B, T, S*H]` (storage dtype), scale `[B, T, S]`
        (float8) and rope_pos `[A, B, T]` int32, on the CPU; lengths `[B]`."""
        lay, sp = self.layout, self._splits[self.split]
        S, W = lay.num_segments, lay.num_segments * lay.hidden_size
        fp8 = lay.dtype == "float8"
        B = len(rows)
        hidden = torch.zeros(B, T, W, dtype=STORAGE[lay.dtype])
        scale = torch.zeros(B, T, S) if fp8 else None
        rope = torch.zeros(lay.rope_axes, B, T, dtype=torch.int32)
        lengths = torch.zeros(B, dtype=torch.long)
        for b, row in enumerate(rows):
            shard, start, n = sp.locate(row)
            if n > T:
                raise DataError(
                    f"dataset row {row} has {n} tokens in the feature cache but at most {T} "
                    "in the batch: the cache was written from other data"
                )
            f = sp.handle(shard)
            hidden[b, :n] = f.get_slice("hidden")[start : start + n]
            if fp8:
                scale[b, :n] = f.get_slice("scale")[start : start + n]
            rope[:, b, :n] = f.get_slice("rope_pos")[:, start : start + n]
            lengths[b] = n
        out = {"hidden": hidden, "rope_pos": rope, "lengths": lengths}
        if fp8:
            out["scale"] = scale
        return out

    @torch.no_grad()
    def batch_output(self, batch: dict[str, torch.Tensor], features: FeatureSpec) -> TargetOutput:
        """The target's output for a collated training batch, read from the cache: the batch's
        rows `index [B]`, right-padded to its `input_ids [B, T]`."""
        ids = batch["input_ids"]
        B, T = ids.shape
        dev = ids.device
        lay = self.layout
        r = self.read_rows(batch["index"].tolist(), T)
        real = batch["attention_mask"].sum(-1).cpu()
        if not torch.equal(real, r["lengths"]):
            b = int((real != r["lengths"]).nonzero()[0])
            raise DataError(
                f"dataset row {int(batch['index'][b])} has {int(r['lengths'][b])} tokens in the "
                f"feature cache but {int(real[b])} in the batch: the cache was written from "
                "other data"
            )
        H, S = lay.hidden_size, lay.num_segments
        hidden = r["hidden"].to(dev)
        scale = r["scale"].to(dev) if "scale" in r else None
        cols = lay.columns(features)

        def segments(idx: list[int]) -> torch.Tensor:  # [B, T, len(idx)*H]
            if idx == list(range(idx[0], idx[0] + len(idx))):  # contiguous: one slice
                lo, hi = idx[0], idx[0] + len(idx)
                h, s = hidden[..., lo * H : hi * H], None if scale is None else scale[..., lo:hi]
            else:
                h = torch.cat([hidden[..., i * H : (i + 1) * H] for i in idx], dim=-1)
                s = None if scale is None else scale[..., idx]
            return decode(h, s, len(idx), self.dtype)

        feats = segments(cols) if cols else None
        head = HeadLogits(segments([S - 1]), self.head)  # logits computed where scored
        rope = r["rope_pos"].to(dev).long()
        rope_pos = rope[0] if lay.rope_axes == 1 else rope
        empty = torch.zeros(B, T, 0, dtype=self.dtype, device=dev)
        return TrainTargetOutput(None, feats, rope_pos, empty, head=head)
