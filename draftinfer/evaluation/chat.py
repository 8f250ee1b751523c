"""Chat data loading shared by training and the runner: conversations in `messages` format
from a hub dataset, a local `.json`/`.jsonl`/`.parquet` file or directory, or `zoo:<name>`.

A *conversation* is a list of messages `{"role": "system" | "user" | "assistant" | ...,
"content": str}` (plus optional keys a template may read, e.g. `reasoning_content`).
ShareGPT rows (`{"from": "human" | "gpt" | "system", "value": str}`) are normalized into this
form. Multimodal rows (vision-language targets) have list `content`: parts
`{"type": "text", "text": str}` and `{"type": "image", "image": REF}` (a path relative to the
data file's folder, `data_base_dir`, or a `datasets` Image), or TRL's layout with the images in
an `images` column (`row_messages` puts them inline); `draftinfer.families.qwen3_vl.processor` turns them
into a VL target's inputs. `datasets` is imported lazily.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftinfer.files.errors import DataError
from draftinfer.files.paths import ZOO_PREFIX, resolve_path

if TYPE_CHECKING:
    import datasets

# Local file types and the `datasets` builder that reads each.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# The manifest of a `python -m drafttrain.regenerate` output directory: loading such a
# directory before every shard is written would silently train on part of the data.
# Written through `drafttrain.trainer.shards` (format + version); version 1 put both in `format`.
REGEN_MANIFEST = "manifest.json"
REGEN_FORMAT, REGEN_VERSION = "drafttrain-regeneration", 2
REGEN_FORMAT_V1 = "drafttrain.regenerate/1"

# ShareGPT speaker names -> chat roles.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}


def _one_line(text: str, limit: int = 300) -> str:
    """Collapse a foreign error message to one short line (DataError messages are one line)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --------------------------------------------------------------------------- loading


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return `messages` as `{"role", "content", ...}` dicts; ShareGPT `{"from", "value"}` is mapped.

    Keys whose value is None are dropped (Arrow fills keys absent from a row with None, and
    templates test `is defined`), except `content`; the same holds inside a list `content`
    (multimodal parts `{"type": "image", "image": ...}` / `{"type": "text", "text": ...}`:
    Arrow gives text parts `image: None`, which a template testing `'image' in part` would
    render as an image). String content is returned as is.
    """
    out = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise DataError(f"a conversation message is {type(msg).__name__}, expected a dict")
        if "role" not in msg and "from" in msg:
            speaker = str(msg["from"]).lower()
            if speaker not in _SHAREGPT_ROLES:
                raise DataError(
                    f"unknown ShareGPT speaker {msg['from']!r}; known: {sorted(_SHAREGPT_ROLES)}"
                )
            rest = {k: v for k, v in msg.items() if k not in ("from", "value") and v is not None}
            out.append({"role": _SHAREGPT_ROLES[speaker], "content": msg.get("value"), **rest})
        elif "role" in msg and msg["role"] is not None:
            out.append({k: v for k, v in msg.items() if v is not None or k == "content"})
            if isinstance(msg.get("content"), list):
                out[-1]["content"] = [_drop_none(p) for p in msg["content"]]
        else:
            raise DataError(
                f"a conversation message has no 'role' (or 'from'); keys: {sorted(msg)}"
            )
    return out


def _drop_none(part: Any) -> Any:
    """A content part without its None-valued keys (non-dict parts unchanged)."""
    return {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part


def row_messages(row: dict[str, Any], field: str = "messages") -> list[dict[str, Any]]:
    """The normalized conversation of a dataset row, its images inline.

    Rows in TRL's vision format keep the images in a separate `images` column and mark their
    places with image parts that carry no image (`{"type": "image", "index": k}` or just
    `{"type": "image"}`): each such part gets `images[index]` (or the row's next image in
    order) as its `image`. A row without an `images` column is normalized only."""
    messages = normalize_messages(row[field])
    images = row.get("images")
    if not images:
        return messages
    order = iter(range(len(images)))
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image" and p.get("image") is None:
                    k = p.get("index")
                    k = next(order, None) if k is None else int(k)
                    if k is None or not 0 <= k < len(images):
                        raise DataError(
                            f"an image part points at image {k} of a row with {len(images)}"
                        )
                    p = {**p, "image": images[k]}
                parts.append(p)
            msg = {**msg, "content": parts}
        out.append(msg)
    return out


def data_base_dir(name_or_path: str) -> Path | None:
    """The folder relative image paths of `name_or_path`'s rows are relative to: the folder of
    a local data file, or a local data directory itself (holding `{split}.jsonl` etc.);
    None for hub datasets (their images are embedded)."""
    path = Path(os.path.expanduser(resolve_path(name_or_path)))
    if path.is_file():
        return path.parent
    return path if path.is_dir() else None


def _is_sharegpt(feature: Any) -> bool:
    """True when a `datasets` feature is a list of structs with `from`/`value` keys."""
    inner = getattr(feature, "feature", None)
    if inner is None and isinstance(feature, list) and feature:
        inner = feature[0]
    return isinstance(inner, dict) and "from" in inner and "value" in inner


def _looks_local(path: str) -> bool:
    return (
        os.path.isabs(path)
        or path.startswith(("./", "../", "~"))
        or os.path.splitext(path)[1].lower() in _BUILDERS
        or os.path.exists(path)
    )


def _check_regeneration(path: str) -> None:
    """A regeneration output directory loads only once it is complete (one-line error)."""
    import json

    manifest = os.path.join(path, REGEN_MANIFEST)
    if not os.path.isfile(manifest):
        return
    try:
        m = json.loads(open(manifest, encoding="utf-8").read())
    except (OSError, ValueError):
        return  # not ours: an unrelated manifest.json
    ours = isinstance(m, dict) and m.get("format") in (REGEN_FORMAT, REGEN_FORMAT_V1)
    if ours and not m.get("complete"):
        raise DataError(
            f"{path!r} is an unfinished regeneration ({len(m.get('shards', []))} of "
            f"{m.get('num_shards')} shards written); rerun python -m drafttrain.regenerate "
            "with the same settings to finish it"
        )


def _local_load_args(path: str, split: str) -> dict[str, Any]:
    """`load_dataset` arguments for a local file or directory."""
    if os.path.isdir(path):
        _check_regeneration(path)
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext not in _BUILDERS:
            raise DataError(f"unsupported data file {path!r}; use one of {sorted(_BUILDERS)}")
        return {"path": _BUILDERS[ext], "data_files": {split: path}}
    for ext, builder in _BUILDERS.items():
        candidate = os.path.join(path, f"{split}{ext}")
        if os.path.isfile(candidate):
            return {"path": builder, "data_files": {split: candidate}}
    # Anything else (sharded files, data/ folders): let `datasets` resolve the directory.
    return {"path": path}


def check_data_path(name_or_path: str) -> tuple[str, bool]:
    """(the resolved path, whether it is local): a one-line `DataError` for a local path (or
    `zoo:` name) that does not exist, before anything is loaded; a hub id passes."""
    path = os.path.expanduser(resolve_path(name_or_path))
    local = name_or_path.startswith(ZOO_PREFIX) or _looks_local(path)
    if local and not os.path.exists(path):
        raise DataError(f"data path {name_or_path!r} does not exist (resolved to {path!r})")
    return path, local


def load_chat_dataset(
    name_or_path: str,
    split: str = "train",
    *,
    name: str | None = None,
    messages_field: str = "messages",
    max_samples: int | None = None,
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """Load conversations as a `datasets.Dataset` with column `messages_field`.

    `name_or_path` is a hub id (with `name`, `split`), a local `.json`/`.jsonl`/`.parquet`
    file, a local directory holding `{split}.jsonl` (or `.json`/`.parquet`) or files `datasets`
    assigns to splits by name (e.g. `data/{split}-00000-of-00004.jsonl`, the layout of
    `python -m drafttrain.regenerate`, which must be complete), or `zoo:<name>`.
    ShareGPT rows are normalized to role/content messages. `max_samples` keeps the first rows.
    """
    import datasets

    path, local = check_data_path(name_or_path)
    args = _local_load_args(path, split) if local else {"path": path, "name": name}
    cache = os.path.join(cache_dir, "datasets") if cache_dir else None
    try:
        ds = datasets.load_dataset(**args, split=split, cache_dir=cache)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFound, ValueError, hub errors)
        where = "local data" if local else "hub dataset"
        raise DataError(
            f"cannot load {where} {name_or_path!r} split {split!r}: {_one_line(e)}"
        ) from e

    field = messages_field
    if field not in ds.column_names:
        raise DataError(
            f"dataset {name_or_path!r} has no column {field!r} (data.messages_field); "
            f"available columns: {ds.column_names}"
        )
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    if _is_sharegpt(ds.features[field]):
        ds = ds.map(
            lambda row: {field: normalize_messages(row[field])},
            desc="normalizing ShareGPT rows",
        )
    return ds
