"""The MTP layers a target checkpoint ships in its own files (DESIGN convention 15), read as
this kind's modules: what `drafter=native` serves (`draftinfer.files.checkpoint.
load_released_drafter`) and what training's `drafter.init=native` starts from.

Which layers and with what semantics is the target family's to say (`FamilySpec.released_mtp`:
DeepSeek-V3's `model.layers.{L+k}.*`, counted by `num_nextn_predict_layers`); the tensors are
read as any export's (`read_drafter_tensors`: the layout's names, experts stacked from the
per-expert tensors the released files hold, every name and shape checked).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftinfer.files.errors import ConfigError


def released_layers(target: str | Path, kind: str) -> tuple[object, dict[str, torch.Tensor]]:
    """(architecture config, module tensors under our names `layers.{k}.*`) of the drafter of
    kind `kind` the target `target` ships; a one-line `ConfigError` when it ships none or one
    of another kind."""
    from draftinfer.files.checkpoint import read_drafter_tensors, released_drafter_config
    from draftinfer.files.target_dir import resolve_checkpoint_dir

    spec, arch, _ = released_drafter_config(target)
    if spec.name != kind:
        raise ConfigError(f"target {target} ships a {spec.name} drafter, not {kind}")
    _, tensors = read_drafter_tensors(resolve_checkpoint_dir(target), spec, arch)
    return arch, tensors
