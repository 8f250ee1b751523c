"""Prompts for tests: held-out zoo chat prompts (in distribution for the zoo target, so trained
drafters accept) and random token prompts (for length / termination mechanics)."""

from __future__ import annotations

import functools
import random


@functools.lru_cache(maxsize=4)
def _zoo_prompt_pool(target: str = "zoo:llama-tiny") -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    from draftinfer.evaluation.prompts import load_conversations, render_prompts
    from draftinfer.files.paths import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path(target))
    convs = load_conversations("zoo:chat", "test", 200)
    return tuple(tuple(p) for p in render_prompts(convs, tok, 300))


def zoo_prompts(n: int, seed: int = 0, target: str = "zoo:llama-tiny") -> list[list[int]]:
    """`n` held-out chat prompts of mixed lengths, chosen by `seed`, rendered by the chat
    template of zoo `target`'s tokenizer."""
    pool = _zoo_prompt_pool(target)
    rng = random.Random(seed)
    return [list(pool[i]) for i in rng.sample(range(len(pool)), n)]


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 400) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
