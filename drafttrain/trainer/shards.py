"""One sharded, resumable, atomically written output: what training checkpoints, the offline
feature cache (`drafttrain.cache`) and regeneration (`drafttrain.regenerate`) all write.

An output is a directory with a `manifest.json` and the files it lists (its *shards*):

    {"format": "drafttrain-feature-cache", "version": 2,   # what wrote it, and which layout
     "complete": false,                                    # every planned shard is listed
     "num_shards": 12,                                     # how many the job plans
     "shards": [{"index": 0, "file": "train/shard_00000.safetensors",
                 "bytes": 123456, "sha256": "...", ...},   # only finished shards, by index
                ...],
     ...}                                                  # the job's own fields (settings,
                                                           # fingerprint, layout, totals)

The rules that make it safe to kill a writer at any instant and to rerun it:
- a file is written under a hidden per-process temp name beside its final name (`.NAME.PID.tmp`:
  `datasets` and globs for `*.jsonl` skip dot files; two processes never share one), fsynced,
  renamed over the final name, and the directory fsynced (`write_atomic`); a directory of files
  (a checkpoint) is written under a temp name and renamed as a whole (`publish_dir`);
- a shard is listed in the manifest only after its file is in place, and the manifest itself is
  replaced atomically: a listed shard is always complete on disk;
- a rerun keeps the listed shards whose file still matches its entry (size and sha256,
  `ShardedOutput.problem`), removes stale temp files and writes the rest;
- a reader refuses, in one line, a manifest of another format or version, an incomplete
  output and a listed file that is missing or altered.

Checkpoints use it per checkpoint directory (its files are its shards) plus a `latest` pointer
file naming the newest complete one (`write_pointer` / `read_pointer`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drafttrain.jobs.errors import DataError

MANIFEST = "manifest.json"
TEMP_SUFFIX = ".tmp"


# ---- atomic files --------------------------------------------------------------------------
def temp_path(path: Path) -> Path:
    """The hidden, per-process temp name `path` is written under before its rename."""
    return path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")


def is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
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


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` as a whole or not at all: temp file, fsync, rename, fsync the directory.
    A kill at any instant leaves the old file or the new one under `path`, never a part."""
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_dir(tmp: Path, final: Path) -> None:
    """Publish the directory `tmp` as `final` in one rename, after fsyncing every file in it
    (the data is on disk before the rename makes it visible); an old `final` is replaced."""
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def remove_temp_files(*dirs: Path) -> None:
    """Temp files a killed writer left behind in `dirs` (never listed, never read)."""
    for d in dirs:
        if d.is_dir():
            for p in d.iterdir():
                if is_temp(p) and p.is_file():
                    p.unlink()


def write_pointer(path: Path, name: str) -> None:
    """A one-line file naming the newest complete output beside it (`checkpoints/latest`)."""
    write_atomic(path, (name + "\n").encode())


def read_pointer(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


# ---- checksums -----------------------------------------------------------------------------
def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def first_difference(want: dict[str, Any], have: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """`(key, wanted, recorded)` for the first setting (nested dicts flattened to `a.b`, in the
    order of `want`, then keys only `have` holds) whose values differ; None when all match.
    A key one side lacks compares as `"<unset>"`."""
    a, b = _flatten(want), _flatten(have)
    for key in [*a, *(k for k in b if k not in a)]:
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            return key, a.get(key, "<unset>"), b.get(key, "<unset>")
    return None


# ---- the manifest --------------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestFormat:
    """What a job's manifests are: their `format` name and `version`, and how errors read."""

    name: str  # the manifest's "format"
    version: int  # its layout; a reader refuses any other
    what: str  # "feature cache": how messages name an output
    error: type[Exception] = DataError  # the one-line error class of this output's problems
    hint: str = ""  # what to do about an unreadable or old output, appended to the error
    # Format strings older writers used, and their version (for a one-line version error).
    legacy: dict[str, int] = field(default_factory=dict)

    def new(self, num_shards: int, **fields: Any) -> dict[str, Any]:
        return {
            "format": self.name,
            "version": self.version,
            "complete": False,
            "num_shards": num_shards,
            "shards": [],
            **fields,
        }

    def _fail(self, message: str) -> Exception:
        return self.error(message + (f"; {self.hint}" if self.hint else ""))

    def read(self, root: Path) -> dict[str, Any] | None:
        """The manifest at `root` (None when there is none); one-line errors for one that is
        unreadable, of another format, or of another version."""
        path = root / MANIFEST
        if not path.is_file():
            return None
        try:
            m = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"corrupted {self.what} manifest {path}: {e}") from None
        name = m.get("format") if isinstance(m, dict) else None
        version = m.get("version") if isinstance(m, dict) else None
        if name in self.legacy:
            version = self.legacy[name]
        elif name != self.name:
            raise self.error(f"{path} is not a {self.what} manifest (format {self.name!r})")
        if version != self.version:
            raise self._fail(
                f"{path}: {self.what} format version {version}, this code reads {self.version}"
            )
        return m

    def write(self, root: Path, manifest: dict[str, Any]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(root / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


class ShardedOutput:
    """A directory of shards and its manifest, kept in memory and rewritten atomically after
    every shard (module docstring)."""

    def __init__(self, root: Path, fmt: ManifestFormat, manifest: dict[str, Any]):
        self.root, self.format, self.manifest = root, fmt, manifest

    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.manifest["shards"]

    @property
    def num_shards(self) -> int:
        return self.manifest["num_shards"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    def done(self) -> dict[int, dict[str, Any]]:
        """Listed shards by index."""
        return {e["index"]: e for e in self.shards}

    def problem(self, entry: dict[str, Any], checksums: bool = True) -> str | None:
        """Why the file of a listed shard cannot be used (missing, another size, another
        sha256), naming it; None when it matches its entry."""
        path = self.root / entry["file"]
        what = f"{self.format.what} file {path}"
        if not path.is_file():
            return f"{what} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return (
                f"{what} is truncated or altered: {size} bytes, the manifest records "
                f"{entry['bytes']}"
            )
        if checksums and sha256_file(path) != entry["sha256"]:
            return f"{what} fails its sha256 checksum"
        return None

    def check(self, entries: Iterable[dict[str, Any]] | None = None, checksums=True) -> None:
        """A one-line error naming the first listed file (of `entries`, default all) that is
        missing or altered."""
        for e in self.shards if entries is None else entries:
            bad = self.problem(e, checksums)
            if bad:
                raise self.format._fail(bad)

    def keep_verified(
        self, old: dict[str, Any], same: Callable[[dict[str, Any]], bool] | None = None
    ) -> None:
        """Resume: list the shards of the `old` manifest whose file still matches its entry
        and which `same(entry)` accepts (the job's plan for that index agrees)."""
        kept = [
            e for e in old.get("shards", []) if (same is None or same(e)) and not self.problem(e)
        ]
        self.manifest["shards"] = sorted(kept, key=lambda e: e["index"])

    def save(self) -> None:
        self.manifest["complete"] = len(self.shards) == self.num_shards
        self.format.write(self.root, self.manifest)

    def entry(self, index: int, name: str, data: bytes | None = None, **fields) -> dict:
        """The entry of shard `index` stored at `root/name` (`data`: its bytes, else read
        back from the file)."""
        path = self.root / name
        size = len(data) if data is not None else path.stat().st_size
        digest = sha256_bytes(data) if data is not None else sha256_file(path)
        return {"index": index, "file": name, "bytes": size, "sha256": digest, **fields}

    def add(self, entry: dict[str, Any]) -> None:
        """List a shard whose file is in place (replacing an entry of the same index)."""
        rest = [e for e in self.shards if e["index"] != entry["index"]]
        self.manifest["shards"] = sorted([*rest, entry], key=lambda e: e["index"])

    def commit(self, index: int, name: str, data: bytes, **fields: Any) -> dict[str, Any]:
        """Write shard `index` to `root/name` atomically, then list it and save the manifest:
        after a kill the shard is either listed and complete or not listed."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
        e = self.entry(index, name, data, **fields)
        self.add(e)
        self.save()
        return e
