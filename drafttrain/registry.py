"""The registries of training (STYLE rule 5), in one module: the training side of each drafter
kind and of each target family, registered from their own folders under `drafttrain/kinds/`
and `drafttrain/families/` (`draftinfer.registry.NamedRegistry`).

## Drafter kinds
Training side of a drafter kind: one `TrainSpec` per kind, registered from the kind's own
files under `drafttrain/kinds/<kind>/` (the same names as `draftinfer.registry.DRAFTERS`; a
test asserts both registries name the same kinds).

A spec answers what `train(cfg)` needs and nothing in `train.py` names a kind:
- `config_class`: the kind's training-config dataclass (a `DrafterTrainConfig`), registered
  with Hydra as `drafter/<kind>_schema`;
- `init_drafter(cfg, ctx)`: the drafter module, its architecture derived from the target
  (`ctx.target.info`, its config) and initialised (shared embeddings, draft vocabulary, ...);
- `features(cfg, ctx)`: the drafter's `FeatureSpec` (what it consumes from the target), which
  the offline feature cache (`drafttrain.cache`) writes without building the drafter;
- `objective(drafter, cfg, backend, loss)`: the training objective, a callable
  `(batch, TargetOutput) -> (loss, metrics)` with `checkpoint_meta()` (what the export
  records, incl. `serving_k`, the draft length it advertises) and
  `anchor_logits(ids, features, rope_pos, anchor, k)` (the train/serve parity test S9); its
  rows are scored with `loss` (`trainer.loss`, `drafttrain.objectives.loss_fns`), passed to the fused
  head + loss call;
- `blocks(drafter)`: the decoder blocks `trainer.compile` and
  `trainer.activation_checkpointing` wrap (`drafttrain.trainer.wrap`).


## Target families
Target families on the training side (DESIGN 2.1): one `TrainFamily` per family, registered
from its own folder under `drafttrain/families/` with the same name as the runner's
`draftinfer.families` spec (a test pins the two registries together). Which family a target
belongs to is the runner's answer, from the architecture in its `config.json`
(`draftinfer.registry.FAMILIES.for_architectures`; an unclaimed architecture is a `causal_lm`).

A `TrainFamily` gives
- `target(cfg, device)`: the frozen target (a `drafttrain.frozen.target.FrozenTarget` subclass),
  loaded with `target_config(cfg)`: the target config as the family loads it (e.g. gpt-oss
  forces eager attention: its sinks have no SDPA path in transformers), which every job that
  loads the target through transformers uses (regeneration's HF backend too);
- `data(target_name, tokenizer)`: the data adapter: tokenized splits with their collate
  function (text chat, or image+text chat through a processor);
- `chat_tokenizer(tokenizer)`: the tokenizer as the family renders text chat with (gpt-oss pins
  its template's date), and `assistant_message(text)`: a decoded generation as the assistant
  message the family's template renders back (gpt-oss splits the harmony channels into
  `thinking` and `content`): what regeneration (`drafttrain.regenerate`) uses;
- `feature_cache`: whether the offline feature cache (`drafttrain.cache`) can stand in for
  the target (it stores text features only);
- `pipeline_tag`: the Hub pipeline tag of its drafters' model cards;
- `export_fields(target_config)`: extra top-level `config.json` fields of an exported drafter,
  and `card_notes(spec, arch)`: serving facts the model card states for a drafter of kind
  `spec`.

    family = target_family("zoo:qwen3-vl-tiny")      # reads config.json only
    target = family.target(cfg.target, device)
    train_split = family.data(cfg.target.name_or_path, tokenizer).tokenize(cfg.data)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from draftinfer.files.errors import ConfigError
from draftinfer.models.target import FeatureSpec
from draftinfer.registry import FAMILIES, NamedRegistry, check_pair
from drafttrain.objectives.loss_fns import SOFT_CE, RowLoss

if TYPE_CHECKING:  # annotations only
    from drafttrain.jobs.config import TargetConfig


@dataclass
class InitContext:
    target: Any  # drafttrain.frozen.target.FrozenTarget
    tokenizer: Any
    data: Any  # the tokenized training set (`input_ids`, `loss_mask` columns)
    cache_dir: Path


class TrainSpec:
    name: ClassVar[str] = ""
    config_class: ClassVar[type]
    objective_class: ClassVar[type]
    # `trainer.loss` when the config leaves it null (docs/results.md, "Losses on the zoo").
    default_loss: ClassVar[str] = "soft_ce"

    def init_drafter(self, cfg: Any, ctx: InitContext):
        raise NotImplementedError

    def features(self, cfg: Any, ctx: InitContext) -> FeatureSpec:
        """What the drafter consumes from the target. A kind that can derive its
        architecture without building the drafter (vocabulary, weights) overrides this."""
        return self.init_drafter(cfg, ctx).config.features

    def warm_start_heads(self, saved: dict[str, Any], arch: dict[str, Any]) -> tuple[str, ...]:
        """`trainer.init_from` a checkpoint of this kind whose architecture `saved` differs from
        this run's `arch`: the name prefixes of the tensors this run adds and leaves at their
        initialisation (new heads over a trained backbone), every other tensor loaded. Empty
        (the default): such a start is refused, the architectures must be equal."""
        return ()

    def objective(self, drafter, cfg: Any, backend: str, loss: RowLoss = SOFT_CE):
        """The kind's objective, scoring its rows with `loss` (`trainer.loss`)."""
        return self.objective_class(drafter, cfg, backend, loss=loss)

    def blocks(self, drafter) -> list:
        """The drafter's decoder blocks: the modules the trainer compiles and checkpoints from
        outside (`drafttrain.trainer.wrap`). Default: `drafter.layers`."""
        return list(drafter.layers)


TRAIN_SPECS = NamedRegistry("drafttrain.kinds", ConfigError, "drafter kind")


def register_train_kind(spec: TrainSpec) -> TrainSpec:
    return TRAIN_SPECS.register(spec)


def unregister_train_kind(name: str) -> None:
    TRAIN_SPECS.unregister(name)


def load_train_kinds() -> dict[str, TrainSpec]:
    """Import every package under `drafttrain/kinds/` once; each registers itself."""
    return TRAIN_SPECS.load()


def train_spec(kind: str) -> TrainSpec:
    return TRAIN_SPECS.spec(kind)


# --- target families ----------------------------------------------------------------------


class TrainFamily:
    """Base of a family's training side (the default family's, `causal_lm`, is the text one
    that others build on)."""

    name: ClassVar[str] = ""
    feature_cache: ClassVar[bool] = True
    pipeline_tag: ClassVar[str] = "text-generation"

    def target_config(self, cfg: TargetConfig) -> TargetConfig:
        """`cfg` as this family loads the target (default: unchanged)."""
        return cfg

    def target(self, cfg: TargetConfig, device: torch.device):
        """The frozen target (a `drafttrain.frozen.target.FrozenTarget`); each family's own."""
        raise NotImplementedError(f"{type(self).__name__} builds no target")

    def data(self, target_name: str, tokenizer):
        """The data adapter (tokenized splits and their collate function); each family's own."""
        raise NotImplementedError(f"{type(self).__name__} has no data adapter")

    def chat_tokenizer(self, tokenizer):
        """The tokenizer as this family renders text chat with (default: as it is)."""
        return tokenizer

    def assistant_message(self, text: str) -> dict[str, Any]:
        """A generation decoded with its special tokens, as an assistant message."""
        return {"role": "assistant", "content": text}

    def export_fields(self, target_config: Any) -> dict[str, Any]:
        return {}

    def rollout_inputs(
        self, mm_inputs: dict[str, Any], prompt_len: int, total_len: int, device
    ) -> dict[str, torch.Tensor]:
        """A runner prompt's inputs beyond its ids (`Prompt.mm_inputs`) as this family's
        training-batch keys for one sequence of `total_len` tokens, the prompt's `prompt_len`
        then a continuation (on-policy rollouts): per-token rows (`[P]` or `[1, P]`) extended
        over the continuation with 0 (text), every other input as it is."""
        out = {}
        for key, v in mm_inputs.items():
            v = torch.as_tensor(v).to(device)
            per_token = v.dim() == 1 or (v.dim() == 2 and v.shape[0] == 1)
            if per_token and v.shape[-1] == prompt_len:
                pad = v.new_zeros(*v.shape[:-1], total_len - prompt_len)
                v = torch.cat([v, pad], -1).reshape(1, total_len)
            out[key] = v
        return out

    def card_notes(self, spec, arch) -> list[str]:
        """Serving facts for the model card of a drafter of kind `spec` (a `DrafterSpec`) with
        architecture `arch` (its config object)."""
        return []

    def check_kind(self, spec, arch: Any | None = None) -> None:
        """One-line `ConfigError` when drafter kind `spec` (with training config `arch`, when
        given) cannot train on this family."""
        check_pair(spec, FAMILIES.spec(self.name), arch)


TRAIN_FAMILIES = NamedRegistry("drafttrain.families", ConfigError, "target family")


def register_train_family(family: TrainFamily) -> TrainFamily:
    return TRAIN_FAMILIES.register(family)


def unregister_train_family(name: str) -> None:
    TRAIN_FAMILIES.unregister(name)


def train_family(name: str) -> TrainFamily:
    return TRAIN_FAMILIES.spec(name)


def target_family(name_or_path: str) -> TrainFamily:
    """The family of a target named by hub id, local path or `zoo:` name (its config only)."""
    from drafttrain.frozen.target import load_target_config

    archs = getattr(load_target_config(name_or_path), "architectures", None)
    return family_for(list(archs or []))


def family_for(architectures: list[str]) -> TrainFamily:
    """The family serving the first of `architectures` one claims (`causal_lm` otherwise)."""
    return train_family(FAMILIES.for_architectures(architectures).name)
