"""Chat data for training: the assistant-only loss mask (loading conversations lives in
`draftinfer.evaluation.chat`, shared with the runner's prompts).

Terms used here and in the rest of `drafttrain.data`:

- **conversation**: a list of messages `{"role": ..., "content": str}` (`draftinfer.evaluation.chat`).
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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from draftinfer.evaluation.chat import load_chat_dataset, normalize_messages
from drafttrain.jobs.errors import DataError

__all__ = [
    "assistant_spans",
    "end_of_turn_marker",
    "load_chat_dataset",
    "load_data",
    "normalize_messages",
    "tokenize_conversation",
    "tokenize_dataset",
]

if TYPE_CHECKING:
    import datasets

    from drafttrain.jobs.config import DataConfig  # annotations only

# Probe conversation used to learn the end-of-turn marker of a template.
_PROBE_USER = "PROBE_U"
_PROBE_ASSISTANT = "PROBE_A"


def load_data(cfg: DataConfig) -> datasets.Dataset:
    """The conversations `cfg` names (`draftinfer.evaluation.chat.load_chat_dataset`)."""
    return load_chat_dataset(
        cfg.path,
        cfg.split,
        name=cfg.name,
        messages_field=cfg.messages_field,
        max_samples=cfg.max_samples,
        cache_dir=cfg.cache_dir,
    )


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


def _text_of(content: Any) -> Any:
    """A message's content as the text a template prints: a string as is; a list of parts
    (multimodal messages) as its text parts joined."""
    if isinstance(content, list):
        return "".join(
            p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return content


def assistant_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    end_marker: str | None = None,
    render: Callable[[list[dict[str, Any]], bool], str] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and return `(text, spans)`: `[start, end)` character spans of `text`
    that the model generates at each assistant turn (rule in the module docstring).

    `end_marker` is `end_of_turn_marker(tokenizer)`; pass it to avoid re-probing per row.
    `render(messages, add_generation_prompt)`: how to render (default: the tokenizer's chat
    template; a processor's for image+text chat, `drafttrain.families.qwen3_vl.data`).
    """
    messages = normalize_messages(messages)
    if render is None:

        def render(msgs, add_generation_prompt):
            return _render(tokenizer, msgs, add_generation_prompt=add_generation_prompt)

    text = render(messages, False)
    if end_marker is None:
        end_marker = end_of_turn_marker(tokenizer)
    spans: list[tuple[int, int]] = []
    for m, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = render(messages[:m], True)
        if not text.startswith(prompt):
            raise DataError(
                f"chat template is not prefix-stable at assistant turn {m}: rendering the "
                "conversation up to it with add_generation_prompt=True is not a prefix of the "
                "full rendering"
            )
        start = len(prompt)
        content = _text_of(msg.get("content"))
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
