"""Training side of the parallel-drafting kind: the EAGLE-3 initialisation plus the mask
token and K, and the drop-token parallel objective, registered as `ptd`."""

from __future__ import annotations

from draftinfer.registry import drafter_spec
from drafttrain.jobs.errors import ConfigError
from drafttrain.kinds.eagle3 import Eagle3TrainSpec
from drafttrain.kinds.eagle3.objective import drafter_config_from_target
from drafttrain.kinds.ptd.config import PTDTrainConfig
from drafttrain.kinds.ptd.objective import PTDObjective
from drafttrain.registry import InitContext, register_train_kind


class PTDTrainSpec(Eagle3TrainSpec):
    name = "ptd"
    config_class = PTDTrainConfig
    objective_class = PTDObjective
    # D-PACE per rollout: +0.097 AL over soft_ce on the zoo (1.796 vs 1.699 at K=4), beyond
    # the seed-to-seed spread of 0.036 (docs/results.md, "Losses on the zoo").
    default_loss = "dpace"

    def arch(self, cfg, ctx: InitContext):
        vocab = ctx.target.info.vocab_size
        mask_id = cfg.mask_token_id
        if mask_id is None:
            pad = ctx.tokenizer.pad_token_id
            mask_id = pad if pad is not None else vocab - 1
        if not 0 <= mask_id < vocab:
            raise ConfigError(
                f"mask_token_id {mask_id} is outside the target vocabulary [0, {vocab})"
            )
        return drafter_config_from_target(
            cfg,
            ctx.target,
            drafter_spec(self.name).config_class,
            mask_token_id=int(mask_id),
            parallel_k=cfg.parallel_k,
        )


register_train_kind(PTDTrainSpec())

__all__ = ["PTDObjective", "PTDTrainConfig", "PTDTrainSpec"]
