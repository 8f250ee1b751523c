"""Small random drafters of any registered kind, built the way training builds them: the
kind's `TrainSpec.init_drafter` against a tiny saved target (so a new kind gets them by
registering). `rope="mrope"` gives the target an interleaved M-RoPE rope config, so the
drafter's rotary reads `[3, B, T]` positions (the target's own HF rotary is not used)."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import torch

SMALL_TARGET = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
ROPES = {
    "1d": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    },
    "mrope": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
}
# Train-config fields a kind may have, set for small drafters when it has them (vocabulary
# fields follow the target).
SMALL_TRAIN = {"num_layers": 1, "parallel_k": 5}


@functools.lru_cache(maxsize=4)
def small_target_dir(rope: str = "1d") -> str:
    from transformers import LlamaConfig

    from tests.support.tiny_models import save_tiny_target

    cfg = LlamaConfig(**SMALL_TARGET, rope_parameters=dict(ROPES[rope]), tie_word_embeddings=False)
    return str(save_tiny_target(cfg, Path(tempfile.mkdtemp(prefix=f"small_{rope}_"))))


@functools.lru_cache(maxsize=1)
def small_vl_dir() -> str:
    """The tiny random Qwen3-VL of `tests.support.vl_fixtures`, saved once per process."""
    from tests.support.vl_fixtures import save_tiny_vl

    return str(save_tiny_vl(Path(tempfile.mkdtemp(prefix="small_vl_"))))


@functools.lru_cache(maxsize=8)
def _frozen(target_dir: str):
    """The training target of `target_dir`, as its target family builds it."""
    from drafttrain.jobs.config import TargetConfig
    from drafttrain.registry import target_family

    cfg = TargetConfig(name_or_path=target_dir)
    return target_family(target_dir).target(cfg, torch.device("cpu"))


def frozen_target(target_dir: str):
    """The training target of `target_dir` (public name of `_frozen`)."""
    return _frozen(target_dir)


def randomized(d: torch.nn.Module) -> torch.nn.Module:
    """O(1) weights so comparisons are not trivially between tiny numbers; eval mode."""
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    return d.eval()


def config_and_drafter_for(kind: str, target_dir: str, seed: int = 0, **train_overrides):
    """(the kind's training config, a randomized drafter of `kind` built for the target in
    `target_dir` by the kind's own `TrainSpec.init_drafter`: identity draft vocabulary, mask
    token = the last id)."""
    import datasets

    from drafttrain.registry import InitContext, train_spec

    target = _frozen(str(target_dir))
    V = target.info.vocab_size
    spec = train_spec(kind)
    fields = {f.name for f in dataclasses.fields(spec.config_class)}
    wanted = {**SMALL_TRAIN, "draft_vocab_size": V, "mask_token_id": V - 1, **train_overrides}
    cfg = spec.config_class(**{k: v for k, v in wanted.items() if k in fields})
    data = datasets.Dataset.from_dict({"input_ids": [list(range(V))], "loss_mask": [[1] * V]})
    ctx = InitContext(target, None, data, Path(tempfile.mkdtemp()))
    torch.manual_seed(seed)
    return cfg, randomized(spec.init_drafter(cfg, ctx))


def drafter_for(kind: str, target_dir: str, seed: int = 0, **train_overrides):
    """A randomized drafter of `kind` built for the target in `target_dir` by the kind's own
    `TrainSpec.init_drafter` (identity draft vocabulary, mask token = the last id)."""
    return config_and_drafter_for(kind, target_dir, seed, **train_overrides)[1]


def small_target(rope: str = "1d"):
    """The small target as training runs it (`drafttrain.frozen.target.FrozenTarget`)."""
    return _frozen(small_target_dir(rope))


def small_drafter(kind: str, rope: str = "1d", seed: int = 0, **train_overrides):
    """A randomized drafter of `kind` for the small target (vocabulary 97)."""
    return drafter_for(kind, small_target_dir(rope), seed, **train_overrides)


def small_embeddings(d: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The small target's shared weights (what `load_drafter` needs)."""
    return _frozen(small_target_dir("1d")).shared_weights()


def servable(kind: str, arch, k: int) -> bool:
    """Whether a drafter of `kind` with architecture `arch` drafts `k` tokens per round."""
    from draftinfer.files.errors import CheckpointError
    from draftinfer.registry import drafter_spec

    try:
        drafter_spec(kind).check_k(arch, k)
    except CheckpointError:
        return False
    return True


def kinds_for_family(family: str) -> list[str]:
    """The registered kinds that pair with target family `family` (`check_pair`): the kind x
    family pairs the catalogue runs."""
    from draftinfer.files.errors import ConfigError
    from draftinfer.registry import check_pair, drafter_spec, family_spec, registered_kinds

    fits = []
    for kind in registered_kinds():
        try:
            check_pair(drafter_spec(kind), family_spec(family))
        except ConfigError:
            continue
        fits.append(kind)
    return fits
