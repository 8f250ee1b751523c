"""Chat data: loading conversations, and the assistant-only loss mask.

Terms used here and in the rest of `drafttrain.data`:

- **conversation**: a list of messages `{"role": "system" | "user" | "assistant" | ..., "content": str}`
  (plus optional keys a template may read, e.g. `reasoning_content`). ShareGPT rows
  (`{"from": "human" | "gpt" | "system", "value": str}`) are normalized into this form.
- **rendered text** `F`: the whole conversation rendered by the tokenizer's own chat template
  (`apply_chat_template(messages, tokenize=False)`).
- **end-of-turn marker**: the text the template appends after an assistant message's content
  to close the turn (`<|eot_id|>` for Llama-3, `<|im_end|>` for Qwen3). It is learned once per
  tokenizer by rendering a probe conversation, never hard-coded.
- **assistant span**: the characters of `F` that the model *generates* at one assistant turn.
- **loss mask**: 1 for a token whose characters overlap an assistant span, else 0. The drafter
  is trained to predict exactly these tokens, i.e. what the target produces when it serves.

The assistant-span rule (no template-specific strings, no magic offsets):

1. `A_m` = render(messages[:m], add_generation_prompt=True) for assistant turn `m`. The
   template must be *prefix-stable*: `F.startswith(A_m)`; otherwise the turn's start is
   undefined and we raise `DataError`. The span starts at `len(A_m)`, so the generation
   prompt (`<|start_header_id|>assistant<|end_header_id|>\\n\\n`, `<|im_start|>assistant\\n`)
   is *not* in the span: the serving engine feeds it, the model never generates it.
2. The span ends right after the first end-of-turn marker found after the message content
   (located with `F.find(content, start)`; from `start` if the template altered the content).
   The whitespace a template prints after the marker (Qwen3's `\\n`) is outside the span: the
   model stops at the marker.

So the span holds everything the template puts between the generation prompt and the end of
the turn, e.g. for Qwen3's last turn `<think>\\n\\n</think>\\n\\nanswer<|im_end|>`: the model
generates the (empty) think block itself.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from drafttrain.config import DataConfig
from drafttrain.errors import DataError

if TYPE_CHECKING:
    import datasets

# Local file types and the `datasets` builder that reads each.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

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

# Probe conversation used to learn the end-of-turn marker of a template.
_PROBE_USER = "PROBE_U"
_PROBE_ASSISTANT = "PROBE_A"


def _one_line(text: str, limit: int = 300) -> str:
    """Collapse a foreign error message to one short line (DataError messages are one line)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --------------------------------------------------------------------------- loading


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return `messages` as `{"role", "content", ...}` dicts; ShareGPT `{"from", "value"}` is mapped.

    Keys whose value is None are dropped (Arrow fills keys absent from a row with None, and
    templates test `is defined`), except `content`.
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
        else:
            raise DataError(
                f"a conversation message has no 'role' (or 'from'); keys: {sorted(msg)}"
            )
    return out


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


def _local_load_args(path: str, split: str) -> dict[str, Any]:
    """`load_dataset` arguments for a local file or directory."""
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


def load_chat_dataset(cfg: DataConfig) -> datasets.Dataset:
    """Load the conversations named by `cfg` as a `datasets.Dataset` with column `cfg.messages_field`.

    `cfg.path` is a hub id (with `cfg.name`, `cfg.split`), a local `.json`/`.jsonl`/`.parquet`
    file, a local directory holding `{split}.jsonl` (or `.json`/`.parquet`), or `zoo:<name>`.
    ShareGPT rows are normalized to role/content messages. `cfg.max_samples` keeps the first rows.
    """
    import datasets

    path = cfg.path
    if path.startswith("zoo:"):
        from draftinfer.paths import resolve_path

        path = resolve_path(path)
    path = os.path.expanduser(path)
    local = cfg.path.startswith("zoo:") or _looks_local(path)
    if local and not os.path.exists(path):
        raise DataError(f"data path {cfg.path!r} does not exist (resolved to {path!r})")

    args = _local_load_args(path, cfg.split) if local else {"path": path, "name": cfg.name}
    cache_dir = os.path.join(cfg.cache_dir, "datasets") if cfg.cache_dir else None
    try:
        ds = datasets.load_dataset(**args, split=cfg.split, cache_dir=cache_dir)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFound, ValueError, hub errors)
        where = "local data" if local else "hub dataset"
        raise DataError(
            f"cannot load {where} {cfg.path!r} split {cfg.split!r}: {_one_line(e)}"
        ) from e

    field = cfg.messages_field
    if field not in ds.column_names:
        raise DataError(
            f"dataset {cfg.path!r} has no column {field!r} (data.messages_field); "
            f"available columns: {ds.column_names}"
        )
    if cfg.max_samples is not None:
        ds = ds.select(range(min(cfg.max_samples, len(ds))))
    if _is_sharegpt(ds.features[field]):
        ds = ds.map(
            lambda row: {field: normalize_messages(row[field])},
            desc="normalizing ShareGPT rows",
        )
    return ds


# --------------------------------------------------------------------------- spans


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"tokenizer {name!r} has no chat template; training needs one to find assistant turns"
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def end_of_turn_marker(tokenizer: Any) -> str:
    """The text the chat template closes an assistant turn with, e.g. `<|eot_id|>`.

    Learned by rendering `[user PROBE_U, assistant PROBE_A]` and taking what follows the
    assistant content, minus trailing whitespace (which the model does not generate).
    May be empty for a template that appends nothing.
    """
    probe = [
        {"role": "user", "content": _PROBE_USER},
        {"role": "assistant", "content": _PROBE_ASSISTANT},
    ]
    text = _render(tokenizer, probe, add_generation_prompt=False)
    at = text.rfind(_PROBE_ASSISTANT)
    if at < 0:
        raise DataError("chat template drops the assistant content of a probe conversation")
    return text[at + len(_PROBE_ASSISTANT) :].rstrip()


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, Any]], end_marker: str | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and return `(text, spans)`: `[start, end)` character spans of `text`
    that the model generates at each assistant turn (rule in the module docstring).

    `end_marker` is `end_of_turn_marker(tokenizer)`; pass it to avoid re-probing per row.
    """
    messages = normalize_messages(messages)
    text = _render(tokenizer, messages, add_generation_prompt=False)
    if end_marker is None:
        end_marker = end_of_turn_marker(tokenizer)
    spans: list[tuple[int, int]] = []
    for m, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:m], add_generation_prompt=True)
        if not text.startswith(prompt):
            raise DataError(
                f"chat template is not prefix-stable at assistant turn {m}: rendering the "
                "conversation up to it with add_generation_prompt=True is not a prefix of the "
                "full rendering"
            )
        start = len(prompt)
        content = msg.get("content")
        content_end = start
        if isinstance(content, str) and content:
            # Templates may trim the content (Llama-3 does); look for it as rendered.
            for needle in (content, content.strip()):
                at = text.find(needle, start) if needle else -1
                if at >= 0:
                    content_end = at + len(needle)
                    break
        if end_marker:
            at = text.find(end_marker, content_end)
            if at < 0:
                raise DataError(
                    f"end-of-turn marker {end_marker!r} not found after assistant turn {m}"
                )
            end = at + len(end_marker)
        else:
            end = content_end
        spans.append((start, end))
    return text, spans


# --------------------------------------------------------------------------- tokenizing


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_length: int,
    end_marker: str | None = None,
) -> dict[str, list[int]]:
    """Tokenize one conversation: `{"input_ids": [T], "loss_mask": [T]}`, `T <= max_length`.

    A token is in the loss mask iff its character span overlaps an assistant span. Special
    tokens are not added here: the chat template already writes BOS where the model wants it.
    """
    text, spans = assistant_spans(tokenizer, messages, end_marker)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("loss masks need a fast tokenizer (offset mappings); got a slow one")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets = enc["offset_mapping"]

    # Character-level membership, then a token is masked if any of its characters is.
    in_span = bytearray(len(text) + 1)
    for a, b in spans:
        in_span[a:b] = b"\x01" * (b - a)
    mask = []
    for a, b in offsets:
        # A zero-width token (possible with byte fallback) counts by the character it sits on.
        mask.append(1 if any(in_span[a : max(b, a + 1)]) else 0)
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def _tokenize_row(
    row: dict[str, Any], tokenizer: Any, field: str, max_length: int, end_marker: str
) -> dict[str, Any]:
    messages = row[field]
    out = tokenize_conversation(tokenizer, messages, max_length, end_marker)
    out["length"] = len(out["input_ids"])
    # Kept to tell "no assistant turns at all" from "all truncated away" below.
    out["num_assistant_turns"] = sum(
        1 for msg in normalize_messages(messages) if msg["role"] == "assistant"
    )
    out["num_loss_tokens"] = sum(out["loss_mask"])
    return out


def tokenize_dataset(
    dataset: datasets.Dataset, tokenizer: Any, cfg: DataConfig
) -> datasets.Dataset:
    """Tokenize every conversation: columns `input_ids`, `loss_mask` (lists of int), `length`.

    Rows without any loss token are dropped. Raises `DataError` when no row has one.
    Results are cached by `datasets` fingerprinting (same data, tokenizer and config -> reuse).
    """
    field = cfg.messages_field
    if field not in dataset.column_names:
        raise DataError(
            f"dataset {cfg.path!r} has no column {field!r}; available columns: {dataset.column_names}"
        )
    end_marker = end_of_turn_marker(tokenizer)  # probe once, not per row
    tokenized = dataset.map(
        _tokenize_row,
        fn_kwargs={
            "tokenizer": tokenizer,
            "field": field,
            "max_length": cfg.max_length,
            "end_marker": end_marker,
        },
        remove_columns=dataset.column_names,
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        desc="tokenizing conversations",
    )
    if len(tokenized) == 0 or sum(tokenized["num_assistant_turns"]) == 0:
        raise DataError(f"dataset {cfg.path!r} has no assistant turns to train on")
    if sum(tokenized["num_loss_tokens"]) == 0:
        raise DataError(
            f"dataset {cfg.path!r} has no assistant tokens within data.max_length={cfg.max_length}"
        )
    kept = tokenized.filter(
        lambda n: n > 0, input_columns="num_loss_tokens", desc="dropping rows without loss tokens"
    )
    return kept.remove_columns(["num_assistant_turns", "num_loss_tokens"])
