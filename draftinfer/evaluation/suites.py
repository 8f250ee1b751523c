"""Acceptance suites: the public prompt sets the field reports AL on, as data.

A *suite* is a YAML preset under `conf/draftinfer/suite/<name>.yaml` over the typed `SuiteConfig`
below: where the prompts live (HF dataset id, config, split; or a URL of a data file), which
column(s) hold them, the prompt the anchors build from them (`template`), whether only the
first turn is used, how many prompts and how many new tokens. No code here names a suite: a
suite's prompt is built from its template and its columns (`suite_rows`), so a new suite is a
new YAML file. `eval.path=` points a suite at a local copy in the same schema.

    {question}\\nPlease reason step by step, and put your final answer within \\\\boxed{}.

is GSM8K's template: `{column}` is replaced by the row's value of that column (any other
brace is literal text), so the prompt equals the anchors' `str.format` prompt. A column
holding a list (MT-Bench's `prompt`, Spec-Bench's `turns`) gives one value per *turn*; a
string is one turn. `optional` handles columns that only sometimes hold text (Alpaca's
`input`): its placeholder becomes the optional text when the value is non-empty, else "".

A suite may instead name a `messages` column (chat data in `messages` format, the runner's
held-out prompts): its user turns are the turns and a leading system message is the system
prompt. An `image` column (MMStar) puts that image before the first turn's text, for a
target with a processor (Qwen3-VL). Loading goes through `datasets.load_dataset` for real.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftinfer.evaluation.chat import (
    _BUILDERS,
    _local_load_args,
    _looks_local,
    _one_line,
    row_messages,
)
from draftinfer.files.errors import ConfigError, DataError
from draftinfer.files.paths import ZOO_PREFIX, conf_dir, resolve_path

# The presets (`python -m draftinfer eval.suites=[gsm8k]`, `eval=gsm8k`).
SUITE_DIR = conf_dir("draftinfer", "suite")

# `{column}`: a column name in braces; `{}` and other braces are literal text.
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass
class SuiteConfig:
    """One acceptance suite (`conf/draftinfer/suite/<name>.yaml`); `name` is the file's stem."""

    name: str = ""
    # Hub dataset id, an http(s) URL of a .json/.jsonl/.parquet file, a local file or
    # directory, or `zoo:<name>`.
    dataset: str = ""
    # Hub config (`load_dataset(dataset, config, split=split)`); null: none.
    config: str | None = None
    split: str = "test"
    # The user turn: `{column}` placeholders, everything else literal.
    template: str = "{prompt}"
    # column -> the text its placeholder becomes when the row's value is non-empty ("" else).
    optional: dict[str, str] = field(default_factory=dict)
    # A column holding a whole chat conversation (`messages` format) instead of a template.
    messages: str | None = None
    # A column holding an image shown before the first turn's text (vision-language suites).
    image: str | None = None
    # A system prompt before the first turn (null: none; a `messages` row's own one wins).
    system: str | None = None
    # Only the first turn (every anchor but z-lab's HF backend); false: later turns follow the
    # drafter-decoded reply to the turns before them.
    first_turn_only: bool = True
    num_prompts: int = 200
    max_new_tokens: int = 2048
    # Passed to the chat template (Qwen3's thinking switch; other templates ignore it).
    enable_thinking: bool = False
    # Text that marks a row whose prompt was never materialised (SPEED-Bench's hub rows that
    # point at external data): such a row is a one-line error, never a prompt.
    placeholder: str | None = None
    # Who uses this suite and protocol (shown in docs and the report), one line.
    protocol: str = ""

    @property
    def columns(self) -> list[str]:
        """The columns a row must have."""
        if self.messages:
            cols = [self.messages]
        else:
            cols = list(dict.fromkeys(_PLACEHOLDER.findall(self.template)))
            for text in self.optional.values():
                cols += [c for c in _PLACEHOLDER.findall(text) if c not in cols]
        return cols + ([self.image] if self.image else [])


@dataclass
class SuiteRow:
    """One prompt of a suite: the row it came from, its system prompt and its user turns
    (each a string, or a list of content parts when it holds an image)."""

    row: int
    turns: list[Any]
    system: str | None = None

    def conversation(self, replies: list[str]) -> list[dict[str, Any]]:
        """The messages of turn `len(replies)`: the system prompt, then each earlier turn with
        its reply, then this turn's user message."""
        t = len(replies)
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(t):
            msgs += [
                {"role": "user", "content": self.turns[i]},
                {"role": "assistant", "content": replies[i]},
            ]
        return msgs + [{"role": "user", "content": self.turns[t]}]


# --------------------------------------------------------------------------- presets


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITE_DIR.glob("*.yaml"))


def _typed(cls, raw: Any, where: str):
    """`raw` (parsed YAML) as dataclass `cls`; unknown keys and wrong types are one-line errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(names)})")
        hint = hints[key]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = typing.get_args(hint) if union else (hint,)
        if value is None and type(None) in options:
            continue
        allowed = tuple(typing.get_origin(a) or a for a in options if a is not type(None))
        if bool in allowed and not isinstance(value, bool) or not isinstance(value, allowed):
            raise ConfigError(f"{where}: {key} must be {hints[key]}, got {value!r}")
    return cls(**raw)


def load_suite(name_or_path: str) -> SuiteConfig:
    """The suite preset `name` (`conf/draftinfer/suite/<name>.yaml`) or a suite YAML file's path."""
    import yaml

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        path = SUITE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"unknown suite {name_or_path!r}; known: {', '.join(suite_names())} "
                "(or the path of a suite .yaml file)"
            )
    raw = yaml.safe_load(path.read_text()) or {}
    suite = _typed(SuiteConfig, {"name": path.stem, **raw}, f"suite {path.stem!r} ({path})")
    if not suite.dataset:
        raise ConfigError(f"suite {suite.name!r}: dataset is empty")
    for col in suite.optional:
        if f"{{{col}}}" not in suite.template:
            raise ConfigError(
                f"suite {suite.name!r}: optional column {col!r} has no {{{col}}} in the template"
            )
    if suite.num_prompts < 1 or suite.max_new_tokens < 1:
        raise ConfigError(f"suite {suite.name!r}: num_prompts and max_new_tokens must be >= 1")
    return suite


# --------------------------------------------------------------------------- loading


def suite_source(suite: SuiteConfig, local: str | None, n_suites: int) -> str:
    """Where `suite` is read from: its `dataset`, or the local copy `local` (`eval.path`):
    `local/<name>.{jsonl,json,parquet}` or `local/<name>/` when it holds one, else `local`
    itself when it is the only suite of the run."""
    if not local:
        return suite.dataset
    base = Path(os.path.expanduser(resolve_path(local)))
    if base.is_dir():
        for cand in [*(base / f"{suite.name}{ext}" for ext in _BUILDERS), base / suite.name]:
            if cand.exists():
                return str(cand)
    if n_suites == 1:
        return local
    raise DataError(
        f"eval.path={local!r} holds no copy of suite {suite.name!r} (looked for "
        f"{suite.name}.jsonl, .json, .parquet or {suite.name}/ in it)"
    )


def _load(suite: SuiteConfig, source: str):
    """`datasets.load_dataset` for a hub id (with the suite's config and split), a URL of a
    data file, or a local file / directory (its `{split}.*` file or what `datasets` finds)."""
    import datasets

    path = os.path.expanduser(resolve_path(source))
    url = source.startswith(("http://", "https://"))
    local = not url and (source.startswith(ZOO_PREFIX) or _looks_local(path))
    if local and not os.path.exists(path):
        raise DataError(f"suite {suite.name!r}: {source!r} does not exist (resolved to {path!r})")
    if url:
        ext = os.path.splitext(source.split("?")[0])[1].lower()
        if ext not in _BUILDERS:
            raise DataError(f"suite {suite.name!r}: a URL dataset must end in {sorted(_BUILDERS)}")
        args = {"path": _BUILDERS[ext], "data_files": {suite.split: source}}
    elif local:
        args = _local_load_args(path, suite.split)
    else:
        args = {"path": source, "name": suite.config}
    try:
        return datasets.load_dataset(**args, split=suite.split)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types (hub, file, schema)
        raise DataError(
            f"suite {suite.name!r}: cannot load {source!r} split {suite.split!r}: {_one_line(e)}"
        ) from e


def _turn_values(suite: SuiteConfig, value: Any, col: str, where: str) -> list[str]:
    """A template column's value as one string per turn (a string is one turn)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if value is None and col in suite.optional:
        return [""]
    raise DataError(
        f"{where}: column {col!r} must be a string or a non-empty list of strings, "
        f"got {type(value).__name__}"
    )


def _fill(text: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def _template_turns(suite: SuiteConfig, row: dict[str, Any], where: str) -> list[str]:
    per_col = {c: _turn_values(suite, row[c], c, where) for c in suite.columns if c != suite.image}
    n = max(len(v) for v in per_col.values())
    turns = []
    for t in range(n):
        # A column with fewer turns than another repeats its last value (one-turn columns
        # beside a list of turns).
        raw = {c: v[min(t, len(v) - 1)] for c, v in per_col.items()}
        values = {
            c: (_fill(suite.optional[c], raw) if raw[c].strip() else "")
            if c in suite.optional
            else raw[c]
            for c in raw
        }
        turns.append(_fill(suite.template, values))
    return turns


def _messages_turns(suite: SuiteConfig, row: dict[str, Any], where: str):
    """(system prompt, user turns) of a `messages` row."""
    msgs = row_messages(row, suite.messages)
    system = next((m["content"] for m in msgs[:1] if m["role"] == "system"), suite.system)
    turns = [m["content"] for m in msgs if m["role"] == "user"]
    if not turns:
        raise DataError(f"{where}: the conversation has no user turn")
    return system, turns


def suite_rows(suite: SuiteConfig, source: str | None = None, limit: int | None = None):
    """The first `limit` (default `suite.num_prompts`) prompts of `suite` read from `source`
    (default `suite.dataset`): `list[SuiteRow]`. A column the suite reads that the data lacks is
    a one-line `DataError` naming the suite, the column and the columns there are."""
    source = source or suite.dataset
    ds = _load(suite, source)
    missing = [c for c in suite.columns if c not in ds.column_names]
    if missing:
        raise DataError(
            f"suite {suite.name!r}: {source!r} has no column {missing[0]!r} "
            f"(columns: {', '.join(ds.column_names)})"
        )
    limit = suite.num_prompts if limit is None else limit
    ds = ds.select(range(min(limit, len(ds))))
    out = []
    for i, row in enumerate(ds):
        where = f"suite {suite.name!r} row {i}"
        if suite.messages:
            system, turns = _messages_turns(suite, row, where)
        else:
            system, turns = suite.system, _template_turns(suite, row, where)
        if suite.first_turn_only:
            turns = turns[:1]
        if suite.placeholder and any(suite.placeholder in str(t) for t in turns):
            raise DataError(
                f"{where} is an unresolved placeholder ({suite.placeholder[:40]!r}...); "
                "materialise the data first and point eval.path at it (docs/inference.md)"
            )
        if suite.image:
            image = row[suite.image]
            if image is None:
                raise DataError(f"{where}: column {suite.image!r} holds no image")
            turns[0] = [{"type": "image", "image": image}, {"type": "text", "text": turns[0]}]
        out.append(SuiteRow(i, turns, system))
    if not out:
        raise DataError(f"suite {suite.name!r}: {source!r} split {suite.split!r} has no rows")
    return out
