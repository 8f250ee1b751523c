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
   (located with `F.find(content, start)`, searched after the message's thinking when the
   template renders it (`thinking` / `reasoning_content`: a thinking text may contain the
   answer's words); from `start` if the template altered the content). The whitespace a
   template prints after the marker (Qwen3's `\\n`) is outside the span: the model stops at the
   marker. Every search stays before the next assistant turn's generation prompt ends, so a
   span never runs into a later turn.
3. Templates may close the conversation's last message and earlier assistant turns
   differently: harmony (gpt-oss) ends the last one with `<|return|>` (the end of generation)
   and earlier ones with `<|end|>` (`TurnEnds`). Both markers are probed from the template.

So the span holds everything the template puts between the generation prompt and the end of
the turn, e.g. for Qwen3's last turn `<think>\\n\\n</think>\\n\\nanswer<|im_end|>`: the model
generates the (empty) think block itself; for harmony's last turn
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`:
the model generates both channels, their headers and the second `<|start|>assistant` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from draftinfer.evaluation.chat import load_chat_dataset, normalize_messages
from drafttrain.jobs.errors import DataError

__all__ = [
    "TurnEnds",
    "assistant_spans",
    "end_of_turn_marker",
    "end_of_turn_markers",
    "load_chat_dataset",
    "load_data",
    "normalize_messages",
    "tokenize_conversation",
    "tokenize_dataset",
]

if TYPE_CHECKING:
    import datasets

    from drafttrain.jobs.config import DataConfig  # annotations only

# Probe conversations used to learn the end-of-turn markers of a template.
_PROBE_USER = "PROBE_U"
_PROBE_ASSISTANT = "PROBE_A"
_PROBE_USER_2 = "PROBE_V"
_PROBE_ASSISTANT_2 = "PROBE_B"
# Message fields a template may render as the assistant's reasoning before its answer.
THINKING_FIELDS = ("thinking", "reasoning_content")


@dataclass(frozen=True)
class TurnEnds:
    """The markers closing an assistant turn: `last` after the conversation's last message,
    `earlier` after a turn more messages follow (equal for Llama-3 / Qwen3; harmony's are
    `<|return|>` and `<|end|>`). Either may be empty for a template that appends nothing."""

    last: str
    earlier: str

    @classmethod
    def of(cls, marker: str | TurnEnds) -> TurnEnds:
        return marker if isinstance(marker, TurnEnds) else cls(marker, marker)


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


def end_of_turn_markers(tokenizer: Any) -> TurnEnds:
    """The markers closing the last message (`end_of_turn_marker`) and an earlier assistant turn.

    The earlier one is learned from `[user, assistant A, user V, assistant B]`: the text between
    A and the second user turn is the marker plus the user turn's header. When it starts with
    the last turn's marker, both are the same (Llama-3, Qwen3); otherwise the template closes
    earlier turns with a special token of its own, the first token of that text (harmony's
    `<|end|>`). A template that does neither is a `DataError`."""
    last = end_of_turn_marker(tokenizer)
    probe = [
        {"role": "user", "content": _PROBE_USER},
        {"role": "assistant", "content": _PROBE_ASSISTANT},
        {"role": "user", "content": _PROBE_USER_2},
        {"role": "assistant", "content": _PROBE_ASSISTANT_2},
    ]
    text = _render(tokenizer, probe, add_generation_prompt=False)
    a, v = text.find(_PROBE_ASSISTANT), text.find(_PROBE_USER_2)
    if not 0 <= a < v:
        raise DataError("chat template drops the first assistant turn of a two-turn probe")
    between = text[a + len(_PROBE_ASSISTANT) : v]
    if between.startswith(last):
        return TurnEnds(last, last)
    enc = tokenizer(between, add_special_tokens=False, return_offsets_mapping=True)
    first = between[slice(*enc["offset_mapping"][0])] if enc["input_ids"] else ""
    if first and first in tokenizer.get_added_vocab():
        return TurnEnds(last, first)
    raise DataError(
        f"chat template closes an earlier assistant turn with {between!r}, which neither starts "
        f"with the last turn's end-of-turn marker {last!r} nor with a special token"
    )


def _text_of(content: Any) -> Any:
    """A message's content as the text a template prints: a string as is; a list of parts
    (multimodal messages) as its text parts joined."""
    if isinstance(content, list):
        return "".join(
            p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return content


def _find(text: str, needles: tuple[str, ...], start: int, stop: int) -> int:
    """End of the first of `needles` found in `text[start:stop]`, or -1."""
    for needle in needles:
        at = text.find(needle, start, stop) if needle else -1
        if at >= 0:
            return at + len(needle)
    return -1


def assistant_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    end_marker: str | TurnEnds | None = None,
    render: Callable[[list[dict[str, Any]], bool], str] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and return `(text, spans)`: `[start, end)` character spans of `text`
    that the model generates at each assistant turn (rule in the module docstring).

    `end_marker` is `end_of_turn_markers(tokenizer)` (a plain string closes every turn alike);
    pass it to avoid re-probing per row.
    `render(messages, add_generation_prompt)`: how to render (default: the tokenizer's chat
    template; a processor's for image+text chat, `drafttrain.families.qwen3_vl.data`).
    """
    messages = normalize_messages(messages)
    if render is None:

        def render(msgs, add_generation_prompt):
            return _render(tokenizer, msgs, add_generation_prompt=add_generation_prompt)

    text = render(messages, False)
    ends = TurnEnds.of(end_of_turn_markers(tokenizer) if end_marker is None else end_marker)
    turns = [m for m, msg in enumerate(messages) if msg["role"] == "assistant"]
    starts = []
    for m in turns:
        prompt = render(messages[:m], True)
        if not text.startswith(prompt):
            raise DataError(
                f"chat template is not prefix-stable at assistant turn {m}: rendering the "
                "conversation up to it with add_generation_prompt=True is not a prefix of the "
                "full rendering"
            )
        starts.append(len(prompt))
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(turns):
        msg, start = messages[m], starts[i]
        # The turn ends before the next assistant turn's generation prompt has been rendered.
        stop = starts[i + 1] if i + 1 < len(turns) else len(text)
        after = start
        for field in THINKING_FIELDS:  # rendered before the answer, when rendered at all
            thinking = msg.get(field)
            if isinstance(thinking, str) and thinking.strip():
                found = _find(text, (thinking, thinking.strip()), start, stop)
                after = found if found >= 0 else after
                break
        content = _text_of(msg.get("content"))
        content_end = after
        if isinstance(content, str) and content:
            # Templates may trim the content (Llama-3 does); look for it as rendered.
            found = _find(text, (content, content.strip()), after, stop)
            content_end = found if found >= 0 else after
        marker = ends.last if m == len(messages) - 1 else ends.earlier
        if marker:
            end = _find(text, (marker,), content_end, stop)
            if end < 0:
                raise DataError(f"end-of-turn marker {marker!r} not found after assistant turn {m}")
        else:
            end = content_end
        spans.append((start, end))
    return text, spans


# --------------------------------------------------------------------------- tokenizing


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_length: int,
    end_marker: str | TurnEnds | None = None,
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
    row: dict[str, Any], tokenizer: Any, field: str, max_length: int, end_marker: TurnEnds
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
    end_marker = end_of_turn_markers(tokenizer)  # probe once, not per row
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
