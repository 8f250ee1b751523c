"""Prompts for the runner: the first user turn(s) of a chat dataset (the same loader training
uses, `draftinfer.evaluation.chat`), or a `.txt` file with one prompt per line, rendered with the
target's chat template.

The target's family renders them (`FamilySpec.render_prompts`): text families with their
tokenizer; a multimodal family through its processor, where the messages may hold image parts
(paths relative to the data file's folder, or `datasets` images) and each prompt carries the
family's extra inputs as its `mm_inputs` (`draftinfer.decoding.engine.Request`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftinfer.evaluation.chat import data_base_dir, load_chat_dataset, row_messages
from draftinfer.files.errors import ConfigError
from draftinfer.files.paths import resolve_path


@dataclass
class Prompt:
    """A rendered prompt: token ids `[P]` and the target family's extra inputs (None: text)."""

    ids: list[int]
    mm_inputs: dict | None = None
    name: str = ""  # how errors name it, e.g. "test row 3"


def _conversations(source: str, split: str, limit: int) -> list[tuple[str, list[dict]]]:
    """(name, prompt conversation) of up to `limit` rows: each row's messages before its first
    assistant turn (rows that open with an assistant turn are skipped)."""
    path = resolve_path(source)
    if path.endswith(".txt"):
        if not Path(path).is_file():
            raise ConfigError(f"prompts file not found: {source}")
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
        convs = [(f"line {i + 1}", [{"role": "user", "content": ln}]) for i, ln in enumerate(lines)]
    else:
        convs = []
        for i, row in enumerate(load_chat_dataset(source, split)):
            msgs = row_messages(row)
            first_asst = next(
                (j for j, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs)
            )
            if first_asst:
                convs.append((f"{split} row {i}", msgs[:first_asst]))
            if len(convs) >= limit:
                break
    convs = convs[:limit]
    if not convs:
        raise ConfigError(f"no prompts in {source!r}")
    return convs


def load_conversations(source: str, split: str, limit: int) -> list[list[dict]]:
    """Up to `limit` prompt conversations (see `_conversations`)."""
    return [c for _, c in _conversations(source, split, limit)]


def chat_ids(tokenizer, conv: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of one conversation with the generation prompt; `template_kwargs` go to the
    chat template (e.g. Qwen3's `enable_thinking`; templates without the switch ignore it)."""
    enc = tokenizer.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
    )
    return [int(t) for t in (enc["input_ids"] if hasattr(enc, "keys") else enc)]


def render_prompts(convs: list[list[dict]], tokenizer, max_len: int) -> list[list[int]]:
    """Token ids of each conversation with the generation prompt, cut to `max_len` tokens."""
    return [chat_ids(tokenizer, c)[:max_len] for c in convs]


class TextPromptEncoder:
    """A text target's prompts one conversation at a time, its tokenizer loaded once
    (`FamilySpec.prompt_encoder`): for runs that render prompts as they go (a suite's later
    turns follow the replies to the earlier ones)."""

    def __init__(self, target_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(target_path)

    def encode(
        self,
        conv: list[dict],
        name: str = "",
        template_kwargs: dict | None = None,
        base_dir: Path | None = None,
    ) -> Prompt:
        """The whole prompt (never cut; the caller decides what does not fit)."""
        return Prompt(chat_ids(self.tokenizer, conv, template_kwargs), None, name)


def render_text_prompts(
    named: list[tuple[str, list[dict]]], target_path: str, max_len: int
) -> tuple[list[Prompt], object]:
    """(prompts, tokenizer) of a text target: each conversation through its tokenizer's chat
    template with the generation prompt, cut to `max_len` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    ids = render_prompts([c for _, c in named], tokenizer, max_len)
    return [Prompt(p, None, name) for p, (name, _) in zip(ids, named)], tokenizer


def load_prompts(
    source: str, split: str, limit: int, family, target_path: str, max_len: int
) -> tuple[list[Prompt], object]:
    """(prompts, tokenizer) for a target of `family` (`draftinfer.registry.FamilySpec`): its
    `render_prompts` (the tokenizer's chat template for text families; the processor, image
    parts allowed, for a multimodal one). Image paths are relative to the data file's folder."""
    named = _conversations(source, split, limit)
    base_dir = None if resolve_path(source).endswith(".txt") else data_base_dir(source)
    return family.render_prompts(named, target_path, max_len, base_dir)
