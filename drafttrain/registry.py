"""Training side of a drafter kind: one `TrainSpec` per kind, registered from the kind's own
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
  rows are scored with `loss` (`trainer.loss`, `drafttrain.loss_fns`), passed to the fused
  head + loss call;
- `blocks(drafter)`: the decoder blocks `trainer.compile` and
  `trainer.activation_checkpointing` wrap (`drafttrain.wrap`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from draftinfer.errors import ConfigError
from draftinfer.registries import NamedRegistry
from draftinfer.target import FeatureSpec
from drafttrain.loss_fns import SOFT_CE, RowLoss


@dataclass
class InitContext:
    target: Any  # drafttrain.target.FrozenTarget
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

    def objective(self, drafter, cfg: Any, backend: str, loss: RowLoss = SOFT_CE):
        """The kind's objective, scoring its rows with `loss` (`trainer.loss`)."""
        return self.objective_class(drafter, cfg, backend, loss=loss)

    def blocks(self, drafter) -> list:
        """The drafter's decoder blocks: the modules the trainer compiles and checkpoints from
        outside (`drafttrain.wrap`). Default: `drafter.layers`."""
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
