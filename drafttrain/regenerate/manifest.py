"""The output directory of a regeneration and its manifest: what makes a run resumable.

Layout (the Hugging Face "data/<split>-NNNNN-of-MMMMM" convention, so `datasets` infers the
split from a bare directory):

    <output_dir>/manifest.json
    <output_dir>/data/<split>-00000-of-00004.jsonl   # source rows [0, S)
    <output_dir>/data/<split>-00001-of-00004.jsonl   # source rows [S, 2S)  ...

Shard `i` holds the regenerated source rows `[i*S, min((i+1)*S, N))` in source order (minus
the skipped ones). A shard is written to a hidden temp file (`data/.<name>.tmp`: `datasets`
ignores dot files), fsynced, renamed into place; then the manifest, rewritten the same way,
lists it. So after a kill at any instant every file a loader sees is complete, the manifest
lists only shards whose file is on disk, and a rerun redoes exactly the shards it does not
list (a shard renamed but not yet listed is rewritten with the same rows).

The manifest records a fingerprint of every setting that changes the output rows (target,
source data and its row count, decoding settings, shard and batch size, resolved backend and
dtype); a rerun with other settings against the same directory is a one-line `ConfigError`
naming the first setting that differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from draftinfer.chat import REGEN_FORMAT as FORMAT
from draftinfer.chat import REGEN_MANIFEST as MANIFEST
from drafttrain.errors import ConfigError, DataError

DATA_DIR = "data"


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` as a whole or not at all: hidden temp file, fsync, rename, fsync dir."""
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(settings: dict[str, Any]) -> str:
    return sha256_bytes(json.dumps(settings, sort_keys=True).encode())


def _is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


def shard_name(split: str, index: int, num_shards: int) -> str:
    return f"{split}-{index:05d}-of-{num_shards:05d}.jsonl"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def first_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """`key: old != new` for the first setting (sorted by name) that differs."""
    a, b = _flatten(old), _flatten(new)
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            return f"{key}: {a.get(key, '<unset>')!r} != {b.get(key, '<unset>')!r}"
    return "fingerprint"


class Manifest:
    """The manifest of one output directory (`manifest.json`), kept in memory and rewritten
    atomically after every finished shard."""

    def __init__(self, out_dir: Path, data: dict[str, Any]):
        self.out_dir, self.data = out_dir, data

    # -- opening ---------------------------------------------------------------------
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
        path = out_dir / MANIFEST
        if out_dir.exists() and not out_dir.is_dir():
            raise ConfigError(f"regenerate.output_dir {str(out_dir)!r} is a file")
        if path.is_file():
            try:
                old = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise DataError(f"cannot read {path}: {' '.join(str(e).split())}") from None
            if old.get("format") != FORMAT:
                raise ConfigError(f"{path} is not a regeneration manifest ({FORMAT})")
            if old.get("fingerprint") != fp:
                raise ConfigError(
                    f"regenerate.output_dir {str(out_dir)!r} holds a regeneration with other "
                    f"settings ({first_difference(old.get('settings', {}), settings)}); rerun "
                    "with the original settings to resume, or pick a new regenerate.output_dir"
                )
            m = cls(out_dir, old)
            m._check_shard_files()
            return m
        if out_dir.is_dir() and any(not _is_temp(p) for p in out_dir.iterdir()):
            raise ConfigError(
                f"regenerate.output_dir {str(out_dir)!r} is not empty and has no {MANIFEST}: "
                "not a regeneration output"
            )
        num_shards = -(-num_rows // shard_size)
        return cls(
            out_dir,
            {
                "format": FORMAT,
                "fingerprint": fp,
                "settings": settings,
                "split": split,
                "num_source_rows": num_rows,
                "shard_size": shard_size,
                "num_shards": num_shards,
                "complete": False,
                "shards": [],
                "totals": {},
                **info,
            },
        )

    def _check_shard_files(self) -> None:
        for s in self.shards:
            p = self.out_dir / s["file"]
            if not p.is_file() or sha256_bytes(p.read_bytes()) != s["sha256"]:
                raise DataError(
                    f"{p} is listed as complete in {self.out_dir / MANIFEST} but is missing or "
                    "changed; restore it or start over in a new regenerate.output_dir"
                )

    # -- state -----------------------------------------------------------------------
    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.data["shards"]

    @property
    def num_shards(self) -> int:
        return self.data["num_shards"]

    def done(self) -> set[int]:
        return {s["index"] for s in self.shards}

    def shard_rows(self, index: int) -> tuple[int, int]:
        """Source rows `[start, end)` of shard `index`."""
        size, n = self.data["shard_size"], self.data["num_source_rows"]
        return index * size, min((index + 1) * size, n)

    def shard_path(self, index: int) -> Path:
        name = shard_name(self.data["split"], index, self.num_shards)
        return self.out_dir / DATA_DIR / name

    # -- writing ---------------------------------------------------------------------
    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(
            self.out_dir / MANIFEST, (json.dumps(self.data, indent=1) + "\n").encode("utf-8")
        )

    def remove_temp_files(self) -> None:
        """Temp files a killed run left behind (never listed, never loaded)."""
        for d in (self.out_dir, self.out_dir / DATA_DIR):
            if d.is_dir():
                for p in d.iterdir():
                    if _is_temp(p):
                        p.unlink()

    def commit_shard(
        self, index: int, rows: list[dict[str, Any]], source_sha256: str, stats: dict[str, Any]
    ) -> None:
        """Write shard `index` (temp file, fsync, rename), then list it in the manifest."""
        path = self.shard_path(index)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        except (TypeError, ValueError) as e:
            raise DataError(f"a row of shard {index} is not JSON-serializable: {e}") from None
        data = body.encode("utf-8")
        atomic_write(path, data)
        start, end = self.shard_rows(index)
        entry = {
            "index": index,
            "file": f"{DATA_DIR}/{path.name}",
            "rows": [start, end],
            "written": len(rows),
            "sha256": sha256_bytes(data),
            "source_sha256": source_sha256,
            **stats,
        }
        self.data["shards"] = sorted([*self.shards, entry], key=lambda s: s["index"])
        self.data["totals"] = _totals(self.shards)
        self.data["complete"] = len(self.shards) == self.num_shards
        self.save()


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
