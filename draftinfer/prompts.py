"""Prompts for the runner: the first user turn(s) of a chat dataset (the same loader training
uses, `draftinfer.chat`), or a `.txt` file with one prompt per line, rendered with the
target's chat template."""

from __future__ import annotations

from pathlib import Path

from draftinfer.chat import load_chat_dataset, normalize_messages
from draftinfer.errors import ConfigError
from draftinfer.paths import resolve_path


def load_conversations(source: str, split: str, limit: int) -> list[list[dict]]:
    """Up to `limit` prompt conversations: each row's messages before its first assistant
    turn (rows that open with an assistant turn are skipped)."""
    path = resolve_path(source)
    if path.endswith(".txt"):
        if not Path(path).is_file():
            raise ConfigError(f"prompts file not found: {source}")
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
        convs = [[{"role": "user", "content": ln}] for ln in lines]
    else:
        convs = []
        for row in load_chat_dataset(source, split):
            msgs = normalize_messages(row["messages"])
            first_asst = next(
                (i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs)
            )
            if first_asst:
                convs.append(msgs[:first_asst])
            if len(convs) >= limit:
                break
    convs = convs[:limit]
    if not convs:
        raise ConfigError(f"no prompts in {source!r}")
    return convs


def render_prompts(convs: list[list[dict]], tokenizer, max_len: int) -> list[list[int]]:
    """Token ids of each conversation with the generation prompt, cut to `max_len` tokens."""
    out = []
    for c in convs:
        enc = tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        out.append([int(t) for t in ids][:max_len])
    return out
