"""A target checkpoint on disk: its directory (`zoo:` name, local path, or a hub id in the local
HF cache), its `config.json` and generation config, its safetensors files (`model.safetensors`,
or the shards of `model.safetensors.index.json`; pickled `.bin` weights are refused). Nothing
here builds a model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from draftinfer.files.errors import CheckpointError
from draftinfer.files.paths import resolve_path

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_checkpoint_dir(name_or_path: str | Path) -> Path:
    """A local checkpoint directory: `zoo:` shorthand, a local path, or a hub id already in the
    local HF cache (or fetchable when online)."""
    path = resolve_path(str(name_or_path))
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if not local.exists() and _HUB_ID.match(path):
        try:
            from huggingface_hub import snapshot_download

            pattern = ["*.json", "*.safetensors"]
            return Path(snapshot_download(path, allow_patterns=pattern))
        except Exception as e:  # any hub failure means "not found" to the user
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"target checkpoint not found: {path!r} ({first})") from None
    raise CheckpointError(
        f"target checkpoint not found: {path!r} is not a directory (nor a hub id org/name)"
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def read_target_config(name_or_path: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a target checkpoint (a one-line `CheckpointError` when
    there is none)."""
    ckpt = resolve_checkpoint_dir(name_or_path)
    path = ckpt / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {ckpt}")
    return read_json(path)


def eos_token_ids(ckpt: Path, config: dict[str, Any]) -> list[int]:
    """`eos_token_id` of generation_config.json (what HF `generate` stops on), else of
    config.json; an int or a list in either file."""
    gen = ckpt / "generation_config.json"
    eos = read_json(gen).get("eos_token_id") if gen.is_file() else None
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(int(i) for i in ids))


def weight_files(ckpt: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (`model.safetensors`, or the shards
    of `model.safetensors.index.json`); one-line `CheckpointError`s, pickles refused."""
    single, index = ckpt / SAFE_SINGLE, ckpt / SAFE_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [ckpt / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists missing shard(s): {', '.join(missing[:3])}")
        return files
    if single.is_file():
        return [single]
    other = sorted(p.name for p in ckpt.glob("*.bin")) + sorted(p.name for p in ckpt.glob("*.pt"))
    hint = f" (found {other[0]}: pickled weights are not loaded)" if other else ""
    raise CheckpointError(f"no {SAFE_SINGLE} or {SAFE_INDEX} in {ckpt}{hint}")
