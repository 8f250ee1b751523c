"""The shifted data mix of the drift job: the zoo chat data with a share of the assistant
answers rewritten, deterministically, in another style. Fine-tuning the zoo target on it for a
few hundred steps moves its greedy answers the way a policy moves under RL (the questions stay,
the answers the policy gives change), so a drafter trained on the original target falls behind.

Shifts (by name, `online.shift`):
- `reverse_words`: the answer's words in reverse order (a strong shift of next-token statistics
  that keeps the vocabulary: every word was already in the tokenizer's training text);
- `shout`: a fixed preamble before the answer (a milder shift: only the opening moves).
Which conversations are rewritten is a function of their text (`stable_hash`), so the mix is
the same on every machine and every restart.
"""

from __future__ import annotations

from collections.abc import Callable

from drafttrain.jobs.errors import ConfigError
from drafttrain.zoo.text_data import stable_hash


def reverse_words(text: str) -> str:
    return " ".join(reversed(text.split()))


def shout(text: str) -> str:
    return "Here is the answer you asked for. " + text


SHIFTS: dict[str, Callable[[str], str]] = {"reverse_words": reverse_words, "shout": shout}


def shift_fn(name: str) -> Callable[[str], str]:
    if name not in SHIFTS:
        raise ConfigError(f"online.shift must be one of {sorted(SHIFTS)}, got {name!r}")
    return SHIFTS[name]


def shifted(rows: list[dict], name: str, fraction: float) -> list[dict]:
    """`rows` (`{"messages": [...]}`) with the assistant turns of about `fraction` of them
    rewritten by shift `name`; the others unchanged."""
    fn = shift_fn(name)
    out = []
    for row in rows:
        msgs = row["messages"]
        key = "\n".join(m["content"] for m in msgs)
        if stable_hash(key) % 1000 < fraction * 1000:
            msgs = [
                {**m, "content": fn(m["content"])} if m["role"] == "assistant" else m for m in msgs
            ]
        out.append({**row, "messages": msgs})
    return out
