"""Target families: what training needs to know about a kind of target, chosen by the HF
architecture in the target's `config.json` (DESIGN 2.1: a new target family is added by
adding files and registering a name, never by `if multimodal:` branches in shared code).

A `TargetFamily` gives
- `target(cfg, device)`: the frozen target (a `drafttrain.target.FrozenTarget` subclass);
- `data(target_name, tokenizer)`: the data adapter (`drafttrain.data.ChatData`): tokenized
  splits with their collate function (text chat, or image+text chat through a processor);
- `feature_cache`: whether the offline feature cache (`drafttrain.cache`) can stand in for
  the target (it stores text features only);
- `export_fields(target_config)`: extra top-level `config.json` fields of an exported
  drafter, and `card_notes(mode)` (`mode`: the kind's drafting mode, `DrafterSpec.mode`): serving facts the model card states.

Families register themselves from their own modules (`FAMILY_MODULES`); a target whose
architecture no family claims is a text causal LM (`TextFamily`).

    family = target_family("zoo:qwen3-vl-tiny")      # reads config.json only
    target = family.target(cfg.target, device)
    train_split = family.data(cfg.target.name_or_path, tokenizer).tokenize(cfg.data)
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch

from drafttrain.config import TargetConfig

# Modules that register a family on import (each calls `register_family`).
FAMILY_MODULES = ("drafttrain.targets_qwen3_vl",)


class TargetFamily:
    """A text causal LM (Llama, Qwen2/3, Mistral, ...): the default family."""

    name: ClassVar[str] = "text"
    # HF architectures (config.json `architectures`) this family serves.
    architectures: ClassVar[tuple[str, ...]] = ()
    feature_cache: ClassVar[bool] = True

    def target(self, cfg: TargetConfig, device: torch.device):
        from drafttrain.target import FrozenTarget

        return FrozenTarget(cfg, device)

    def data(self, target_name: str, tokenizer):
        from drafttrain.data.batching import ChatData

        return ChatData(tokenizer)

    def export_fields(self, target_config: Any) -> dict[str, Any]:
        return {}

    def card_notes(self, mode: str) -> list[str]:
        return []


TextFamily = TargetFamily

_FAMILIES: dict[str, TargetFamily] = {}
_loaded = False


def register_family(family: TargetFamily) -> TargetFamily:
    for arch in family.architectures:
        if arch in _FAMILIES and _FAMILIES[arch].name != family.name:
            raise ValueError(f"architecture {arch} already served by {_FAMILIES[arch].name}")
        _FAMILIES[arch] = family
    return family


def family_for(architectures: list[str] | None) -> TargetFamily:
    """The family serving the first of `architectures` that one claims; text otherwise."""
    global _loaded
    if not _loaded:
        for module in FAMILY_MODULES:
            importlib.import_module(module)
        _loaded = True
    for arch in architectures or ():
        if arch in _FAMILIES:
            return _FAMILIES[arch]
    return TargetFamily()


def target_family(name_or_path: str) -> TargetFamily:
    """The family of a target named by hub id, local path or `zoo:` name (its config only)."""
    from drafttrain.target import load_target_config

    return family_for(list(getattr(load_target_config(name_or_path), "architectures", None) or []))
