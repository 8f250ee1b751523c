"""Typed schema of `python -m drafttrain.regenerate` (`conf/drafttrain/regenerate.yaml`).

The `target:` and `data:` sections are the training schema's own (`drafttrain.jobs.config`), so
the existing `target/` and `data/` choices compose here unchanged; `regenerate:`
holds what is specific to regeneration. Hydra validates every key against these classes
(a misspelled key is an error naming it) and `__main__` converts once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from drafttrain.jobs.config import DataConfig, TargetConfig
from drafttrain.jobs.errors import ConfigError

TURNS = ("all", "last")
BACKENDS = ("auto", "native", "hf")


@dataclass
class RegenerateConfig:
    # Output directory: `manifest.json` + `data/<split>-NNNNN-of-MMMMM.jsonl` shards.
    output_dir: str = "outputs/regenerated"
    # "all": every assistant turn in order, each conditioned on the regenerated earlier ones;
    # "last": only the last assistant turn (earlier turns keep the dataset's text).
    turns: str = "all"
    # New tokens per assistant turn; a turn that reaches it has finish_reason "length".
    max_new_tokens: int = 512
    # Prompt + response tokens per sequence (capped at the target's max_position_embeddings).
    # A conversation whose prompt for a turn leaves no room for one new token is skipped.
    max_model_len: int = 4096
    # Prompts decoded together (the native backend's KV cache has this many rows).
    batch_size: int = 32
    # Source rows per output shard: the unit of resumption.
    shard_size: int = 1000
    # Sampling: temperature 0 is greedy; top_k 0/-1 and top_p 1.0 are off. Turn `m` of source
    # row `i` is seeded from (seed, i, m), so sampled rows do not depend on the batch (native).
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # "native": draftinfer's target (Llama / Qwen2 / Qwen3); "hf": transformers' `generate`;
    # "auto": native when the target's architecture is native, else hf.
    backend: str = "auto"
    # "auto": cuda when available, else cpu.
    device: str = "auto"
    num_threads: int | None = None
    progress: bool = True


@dataclass
class RegenConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


def check_regen_config(cfg: RegenConfig) -> None:
    """One-line `ConfigError`s for values that would fail later."""
    r = cfg.regenerate
    if r.turns not in TURNS:
        raise ConfigError(f"regenerate.turns must be one of {TURNS}, got {r.turns!r}")
    if r.backend not in BACKENDS:
        raise ConfigError(f"regenerate.backend must be one of {BACKENDS}, got {r.backend!r}")
    for name in ("max_new_tokens", "batch_size", "shard_size"):
        if getattr(r, name) < 1:
            raise ConfigError(f"regenerate.{name} must be >= 1, got {getattr(r, name)}")
    if r.max_model_len < 2:
        raise ConfigError(f"regenerate.max_model_len must be >= 2, got {r.max_model_len}")
    if not r.temperature >= 0.0 or not 0.0 < r.top_p <= 1.0 or r.top_k < -1:
        raise ConfigError(
            "regenerate sampling needs temperature >= 0, 0 < top_p <= 1, top_k >= -1; got "
            f"{r.temperature}, {r.top_p}, {r.top_k}"
        )
    if not r.output_dir:
        raise ConfigError("regenerate.output_dir is required")
