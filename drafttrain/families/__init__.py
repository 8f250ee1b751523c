"""Target families on the training side (DESIGN 2.1): one `TrainFamily` per family, registered
from its own folder under `drafttrain/families/` with the same name as the runner's
`draftinfer.families` spec (a test pins the two registries together). Which family a target
belongs to is the runner's answer, from the architecture in its `config.json`
(`draftinfer.families.FAMILIES.for_architectures`; an unclaimed architecture is a `causal_lm`).

A `TrainFamily` gives
- `target(cfg, device)`: the frozen target (a `drafttrain.target.FrozenTarget` subclass);
- `data(target_name, tokenizer)`: the data adapter: tokenized splits with their collate
  function (text chat, or image+text chat through a processor);
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

from typing import Any, ClassVar

import torch

from draftinfer.errors import ConfigError
from draftinfer.families import FAMILIES, check_pair
from draftinfer.registries import NamedRegistry
from drafttrain.config import TargetConfig


class TrainFamily:
    """Base of a family's training side; the default family uses it as is."""

    name: ClassVar[str] = ""
    feature_cache: ClassVar[bool] = True
    pipeline_tag: ClassVar[str] = "text-generation"

    def target(self, cfg: TargetConfig, device: torch.device):
        from drafttrain.target import FrozenTarget

        return FrozenTarget(cfg, device)

    def data(self, target_name: str, tokenizer):
        from drafttrain.data.batching import ChatData

        return ChatData(tokenizer)

    def export_fields(self, target_config: Any) -> dict[str, Any]:
        return {}

    def card_notes(self, spec, arch) -> list[str]:
        """Serving facts for the model card of a drafter of kind `spec` (a `DrafterSpec`) with
        architecture `arch` (its config object)."""
        return []

    def check_kind(self, spec) -> None:
        """One-line `ConfigError` when drafter kind `spec` cannot train on this family."""
        check_pair(spec, FAMILIES.spec(self.name))


TRAIN_FAMILIES = NamedRegistry("drafttrain.families", ConfigError, "target family")


def register_train_family(family: TrainFamily) -> TrainFamily:
    return TRAIN_FAMILIES.register(family)


def unregister_train_family(name: str) -> None:
    TRAIN_FAMILIES.unregister(name)


def train_family(name: str) -> TrainFamily:
    return TRAIN_FAMILIES.spec(name)


def target_family(name_or_path: str) -> TrainFamily:
    """The family of a target named by hub id, local path or `zoo:` name (its config only)."""
    from drafttrain.target import load_target_config

    archs = getattr(load_target_config(name_or_path), "architectures", None)
    return family_for(list(archs or []))


def family_for(architectures: list[str]) -> TrainFamily:
    """The family serving the first of `architectures` one claims (`causal_lm` otherwise)."""
    return train_family(FAMILIES.for_architectures(architectures).name)
