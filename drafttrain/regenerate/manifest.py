"""The output directory of a regeneration and its manifest: what makes a run resumable.

Layout (the Hugging Face "data/<split>-NNNNN-of-MMMMM" convention, so `datasets` infers the
split from a bare directory):

    <output_dir>/manifest.json
    <output_dir>/data/<split>-00000-of-00004.jsonl   # source rows [0, S)
    <output_dir>/data/<split>-00001-of-00004.jsonl   # source rows [S, 2S)  ...

Shard `i` holds the regenerated source rows `[i*S, min((i+1)*S, N))` in source order (minus
the skipped ones). Files, manifest and resume follow `drafttrain.trainer.shards` (shared with the
feature cache and checkpoints): a shard is written to a hidden temp file (`datasets` ignores
dot files), fsynced, renamed into place; then the manifest, rewritten the same way, lists it
with its size and sha256. So after a kill at any instant every file a loader sees is complete,
the manifest lists only shards whose file is on disk, and a rerun redoes exactly the shards it
does not list (a shard renamed but not yet listed is rewritten with the same rows).

The manifest records a fingerprint of every setting that changes the output rows (target,
source data and its row count, decoding settings, shard and batch size, resolved backend and
dtype); a rerun with other settings against the same directory is a one-line `ConfigError`
naming the first setting that differs. Version 2 is the layout of `drafttrain.trainer.shards`;
version 1 (`"format": "drafttrain.regenerate/1"`) outputs are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftinfer.evaluation.chat import REGEN_FORMAT, REGEN_FORMAT_V1, REGEN_VERSION
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.trainer.shards import (
    MANIFEST,
    ManifestFormat,
    ShardedOutput,
    first_difference,
    is_temp,
    remove_temp_files,
    sha256_bytes,
)

DATA_DIR = "data"
FORMAT = ManifestFormat(
    REGEN_FORMAT,
    REGEN_VERSION,
    "regeneration",
    DataError,
    hint="start over in a new regenerate.output_dir",
    legacy={REGEN_FORMAT_V1: 1},
)


def fingerprint(settings: dict[str, Any]) -> str:
    return sha256_bytes(json.dumps(settings, sort_keys=True).encode())


def shard_name(split: str, index: int, num_shards: int) -> str:
    return f"{split}-{index:05d}-of-{num_shards:05d}.jsonl"


class Manifest(ShardedOutput):
    """The manifest of one output directory (`manifest.json`), kept in memory and rewritten
    atomically after every finished shard."""

    @classmethod
    def open(
        cls,
        out_dir: str | Path,
        settings: dict[str, Any],
        split: str,
        num_rows: int,
        shard_size: int,
        info: dict[str, Any],
    ) -> Manifest:
        """The manifest of `out_dir`: read back when it exists (and must match `settings`),
        else a fresh one, in memory only (`save` writes it). Writes nothing; every error is
        one line."""
        out_dir = Path(out_dir).expanduser()
        fp = fingerprint(settings)
        if out_dir.exists() and not out_dir.is_dir():
            raise ConfigError(f"regenerate.output_dir {str(out_dir)!r} is a file")
        old = FORMAT.read(out_dir) if out_dir.is_dir() else None
        if old is not None:
            if old.get("fingerprint") != fp:
                key, new, was = first_difference(settings, old.get("settings", {})) or (
                    "fingerprint",
                    fp,
                    old.get("fingerprint"),
                )
                raise ConfigError(
                    f"regenerate.output_dir {str(out_dir)!r} holds a regeneration with other "
                    f"settings ({key}: {was!r} != {new!r}); rerun with the original settings "
                    "to resume, or pick a new regenerate.output_dir"
                )
            m = cls(out_dir, FORMAT, old)
            m.check()  # the listed shards are there, unchanged
            return m
        if out_dir.is_dir() and any(not is_temp(p) for p in out_dir.iterdir()):
            raise ConfigError(
                f"regenerate.output_dir {str(out_dir)!r} is not empty and has no {MANIFEST}: "
                "not a regeneration output"
            )
        num_shards = -(-num_rows // shard_size)
        fresh = FORMAT.new(
            num_shards,
            fingerprint=fp,
            settings=settings,
            split=split,
            num_source_rows=num_rows,
            shard_size=shard_size,
            totals=_totals([]),
            **info,
        )
        return cls(out_dir, FORMAT, fresh)

    def shard_rows(self, index: int) -> tuple[int, int]:
        """Source rows `[start, end)` of shard `index`."""
        size, n = self.manifest["shard_size"], self.manifest["num_source_rows"]
        return index * size, min((index + 1) * size, n)

    def shard_file(self, index: int) -> str:
        return f"{DATA_DIR}/{shard_name(self.manifest['split'], index, self.num_shards)}"

    def save(self) -> None:
        self.manifest["totals"] = _totals(self.shards)
        super().save()

    def remove_temp_files(self) -> None:
        """Temp files a killed run left behind (never listed, never loaded)."""
        remove_temp_files(self.root, self.root / DATA_DIR)

    def commit_shard(
        self, index: int, rows: list[dict[str, Any]], source_sha256: str, stats: dict[str, Any]
    ) -> None:
        """Write shard `index` (temp file, fsync, rename), then list it in the manifest."""
        try:
            body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        except (TypeError, ValueError) as e:
            raise DataError(f"a row of shard {index} is not JSON-serializable: {e}") from None
        self.commit(
            index,
            self.shard_file(index),
            body.encode("utf-8"),
            rows=list(self.shard_rows(index)),
            written=len(rows),
            source_sha256=source_sha256,
            **stats,
        )


def _totals(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over the listed shards: rows written, skipped by reason, turns by finish reason."""
    out: dict[str, Any] = {"rows": 0, "written": 0, "skipped": {}, "finish_reasons": {}}
    for s in shards:
        out["rows"] += s["rows"][1] - s["rows"][0]
        out["written"] += s["written"]
        for group in ("skipped", "finish_reasons"):
            for k, v in s.get(group, {}).items():
                out[group][k] = out[group].get(k, 0) + v
    return out
