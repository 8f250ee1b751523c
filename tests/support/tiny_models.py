"""Tiny random-init targets built from scaled-down configs of the *real* architectures,
saved to disk and loaded back through the same `from_pretrained` path training uses."""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def llama3_config(vocab_size: int = 512, layers: int = 6, tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE),
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )


def qwen3_config(vocab_size: int = 512, layers: int = 6, tied: bool = True):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )


def save_tiny_target(config, path: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def write_counting_chat(path: Path, n: int = 120, seed: int = 0) -> Path:
    """Patterned chat data (`count from a` -> `a a+1 ...`) in `messages` jsonl."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a = rng.randint(0, 5)
            answer = " ".join(str(x % 10) for x in range(a, a + rng.randint(6, 14)))
            row = {
                "messages": [
                    {"role": "user", "content": f"count from {a}"},
                    {"role": "assistant", "content": answer},
                ]
            }
            f.write(json.dumps(row) + "\n")
    return path


def make_train_env(root: Path) -> dict[str, str]:
    """A tiny Llama-3-shaped target with a Llama-3 chat tokenizer, plus chat data.

    `initializer_range` is raised so the random target's next-token distributions are peaked
    (with the default 0.02 they are nearly uniform and a drafter has nothing to learn).
    """
    from tests.support.tiny_tokenizers import make_llama3_tokenizer

    tok = make_llama3_tokenizer(root / "tok")
    cfg = llama3_config(vocab_size=len(tok), layers=6)
    cfg.initializer_range = 0.2
    cfg.pad_token_id = tok.pad_token_id
    target = save_tiny_target(cfg, root / "target")
    tok.save_pretrained(str(target))
    data = write_counting_chat(root / "chat.jsonl")
    return {"target": str(target), "data": str(data)}


def untrained_drafter(kind: str, target_dir, target, **train_overrides):
    """A random-init drafter of `kind` built for the target in `target_dir` (by the kind's
    `TrainSpec`), sharing the native `target`'s embeddings. Lossless whatever its quality; its
    acceptance length should be about 1."""
    from draftinfer.registry import drafter_spec
    from tests.support.kind_factories import drafter_for

    d = drafter_for(kind, str(target_dir), **train_overrides)
    drafter_spec(kind).attach_shared(d, target.shared_weights())
    return d.eval()


# Per-kind training overrides of the tiny recipe: the K a kind serves must cover the T1 grid.
TINY_OVERRIDES: dict[str, list[str]] = {"ptd": ["drafter.parallel_k=7"]}


def tiny_recipe(kind: str, env: dict[str, str], out: Path, steps: int, *extra: str) -> list[str]:
    """Overrides of the tiny recipe: any registered kind on the tiny target and chat data."""
    return [
        f"drafter={kind}",
        f"target.name_or_path={env['target']}",
        f"data.path={env['data']}",
        f"output_dir={out}",
        f"trainer.max_steps={steps}",
        "trainer.progress=false",
        "trainer.save_every=0",
        "data.batch_size=4",
        "drafter.draft_vocab_size=96",
        "data.eval_split=null",
        "export.verify=false",
        *TINY_OVERRIDES.get(kind, []),
        *extra,
    ]


def train_tiny_export(kind: str, train_env: dict[str, str], out: Path, steps: int, *extra: str):
    """Briefly train a drafter of `kind` on the tiny target, export it (no runner verification),
    and load target + export back natively: (native target, drafter, meta, export dir, summary)."""
    from draftinfer.files.checkpoint import load_drafter
    from draftinfer.files.loading import load_native_target
    from drafttrain.jobs.job import run_job
    from tests.support.presets import compose_preset

    summary = run_job(compose_preset("eagle3", tiny_recipe(kind, train_env, out, steps, *extra)))
    export = summary["export_dir"]
    target = load_native_target(train_env["target"], max_batch=16, max_seq_len=160)
    drafter, meta = load_drafter(export, target.shared_weights())
    return target, drafter, meta, export, summary
