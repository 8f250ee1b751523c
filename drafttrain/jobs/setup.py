"""The one setup of every job that reads a target and a dataset: training (`drafttrain.jobs.train`),
the offline feature-cache writer (`drafttrain.cache.writer`) and regeneration
(`drafttrain.regenerate.job`). Each job calls these steps in this order, and every check runs
before the job writes anything (`tests/train/test_bad_input.py`):

1. `check_drafter_job(cfg, feature_cache)` (drafter jobs): the kind, the attention backend, the
   trainer dtypes, the kind x family pair (`draftinfer.registry.check_pair`) and, where a
   feature cache is read or written, that the family's features can be cached; the target's
   `config.json` is all it reads;
2. `setup_target(cfg.target)`: the target resolved (`zoo:` names, local paths, hub ids), its
   config, its family (`drafttrain.families`, by architecture) and its tokenizer;
3. `setup_drafter_job(cfg, device, feature_cache)`: 1 + 2 + the frozen target (loaded by its
   family) and the tokenized training split (the family's data adapter);
4. `setup_training(cfg, run_dir, device)`: 3 + the kind's initialised drafter + the target the
   training loop asks for features: the live target, or the feature source standing in for it
   (`data.cache`, `data.emitted`, `data.hidden_states.path`: `drafttrain.sources`), the one
   place where a source meets training, so `train.py` knows only the target interface.

Devices and processes: training runs under the accelerator (`drafttrain.trainer.distributed`, one
process per device), the others in one process on `job_device(name)` (`single_process` refuses
a launcher). Threads: every job runs under `draftinfer.evaluation.threads.torch_threads(n)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftinfer.registry import drafter_spec
from drafttrain.frozen.target import load_target_config, load_tokenizer, resolve_target_path
from drafttrain.jobs.config import TargetConfig, TrainConfig
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.objectives.ttt import pick_backend
from drafttrain.registry import InitContext, TrainFamily, TrainSpec, family_for, train_spec
from drafttrain.sources import selected_source
from drafttrain.trainer.optim import dtype_of

_CPU = torch.device("cpu")


def job_device(name: str = "auto") -> torch.device:
    """`auto`: the GPU when there is one, else the CPU; or a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from None


def single_process(job: str) -> None:
    """A one-line `ConfigError` when a one-process job was started by a launcher: its ranks
    would write the same files."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ConfigError(
            f"{job} runs in one process; start it with `python -m`, not under a launcher "
            f"(WORLD_SIZE={world})"
        )


@dataclass
class TargetSetup:
    """A target as every job first sees it: nothing of its weights loaded yet."""

    name: str  # as configured (`target.name_or_path`)
    path: str  # resolved: a local directory or a hub id
    config: Any  # its transformers config
    family: TrainFamily
    tokenizer: Any

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0


def _target_config(cfg: TargetConfig):
    return load_target_config(
        cfg.name_or_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
    )


def setup_target(cfg: TargetConfig, chat_template: bool = False) -> TargetSetup:
    """Resolve the target, read its config and tokenizer and pick its family. One-line errors
    for a missing target, an unreadable config or tokenizer and, with `chat_template`, a
    tokenizer without a chat template."""
    path = resolve_target_path(cfg.name_or_path)
    config = _target_config(cfg)
    family = family_for(list(getattr(config, "architectures", None) or []))
    tokenizer = load_tokenizer(cfg.name_or_path)
    if chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"tokenizer of {cfg.name_or_path!r} has no chat template; the job renders each "
            "conversation with it"
        )
    return TargetSetup(cfg.name_or_path, path, config, family, tokenizer)


def check_feature_cache(family: TrainFamily, target_name: str) -> None:
    """One-line `ConfigError` for a target family the feature cache cannot stand in for: it
    stores per-token text features, not what a multimodal target's drafter also consumes (the
    vision embeddings scattered into the input, the `[3, T]` M-RoPE positions)."""
    if not family.feature_cache:
        raise ConfigError(
            f"the offline feature cache does not support {family.name} targets "
            f"({target_name!r}): it stores no vision embeddings or M-RoPE positions; "
            "train with the live target (data.cache=null)"
        )


def check_drafter_job(cfg: TrainConfig, feature_cache: bool) -> tuple[TrainSpec, TrainFamily]:
    """Everything about a drafter job that a config and the target's `config.json` decide:
    the kind's spec and the target's family, or a one-line error."""
    spec = train_spec(getattr(cfg.drafter, "kind", None) or "")
    # The name, and on a machine without CUDA a backend that needs it.
    pick_backend(cfg.drafter.attention_backend, None if torch.cuda.is_available() else _CPU)
    dtype_of(cfg.trainer.param_dtype, "param_dtype")
    dtype_of(cfg.trainer.optimizer_dtype, "optimizer_dtype")
    resolve_target_path(cfg.target.name_or_path)
    family = family_for(list(getattr(_target_config(cfg.target), "architectures", None) or []))
    family.check_kind(drafter_spec(spec.name), cfg.drafter)  # the kind x family pair
    if feature_cache:
        check_feature_cache(family, cfg.target.name_or_path)
    return spec, family


def prepare_data(cfg: TrainConfig, adapter):
    """The tokenized training split (a `drafttrain.data.TokenizedSplit`) of a data adapter
    (`TrainFamily.data`: text chat, image+text chat)."""
    split = adapter.tokenize(cfg.data)
    if len(split.data) == 0:
        raise DataError(f"dataset {cfg.data.path!r} has no usable conversations")
    return split


@dataclass
class DrafterJob:
    """A drafter job's target and data, loaded and checked (`setup_drafter_job`)."""

    spec: TrainSpec
    target_setup: TargetSetup
    target: Any  # the live frozen target (`drafttrain.frozen.target.FrozenTarget` or a family's)
    split: Any  # `drafttrain.data.TokenizedSplit`: the tokenized training split
    cache_dir: Path  # tokenized data and the draft vocabulary (`data.cache_dir`)

    @property
    def tokenizer(self):
        return self.target_setup.tokenizer

    @property
    def family(self) -> TrainFamily:
        return self.target_setup.family

    @property
    def pad_id(self) -> int:
        return self.target_setup.pad_id

    def init_context(self) -> InitContext:
        return InitContext(self.target, self.tokenizer, self.split.data, self.cache_dir)


def setup_drafter_job(
    cfg: TrainConfig, device: torch.device, feature_cache: bool = False
) -> DrafterJob:
    """Checks (step 1), then the target (its family's frozen target) and the tokenized data.
    `feature_cache`: the job reads or writes an offline feature cache."""
    spec, _ = check_drafter_job(cfg, feature_cache)
    ts = setup_target(cfg.target)
    target = ts.family.target(cfg.target, device)
    split = prepare_data(cfg, ts.family.data(cfg.target.name_or_path, ts.tokenizer))
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output_dir) / "cache"
    return DrafterJob(spec, ts, target, split, cache_dir)


@dataclass
class TrainingSetup:
    job: DrafterJob
    drafter: torch.nn.Module  # initialised by the kind, on the CPU
    target: Any  # what the loop asks for features: the live target or a feature cache


def setup_training(cfg: TrainConfig, device: torch.device) -> TrainingSetup:
    """Target, data and the initialised drafter: everything of training that can fail on bad
    input, before the run writes anything of its own. With a feature source (`data.cache`,
    `data.emitted`, `data.hidden_states.path`: `drafttrain.sources`) the source is checked
    against the config and the drafter, then stands in for the target (whose body is freed)."""
    source = selected_source(cfg)
    job = setup_drafter_job(cfg, device, feature_cache=source is not None)
    drafter = job.spec.init_drafter(cfg.drafter, job.init_context())
    target = job.target
    if source is not None:  # features read from the source; the target is never run
        target = source.open(cfg, job, drafter.config.features)
        job.target = None  # only the source's head (final norm, output embedding) is kept
    return TrainingSetup(job, drafter, target)
