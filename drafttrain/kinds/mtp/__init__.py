"""Training side of the multi-layer MTP kind: config, objective and initialisation from the
target, registered as `mtp`. The block of each module is the target family's decoder layer:
the native `DecoderLayer` (shared with the runner) for Llama / Qwen2 / Qwen3 targets, the
family's own transformers class otherwise (trainable against any HF causal LM; served by
engines)."""

from __future__ import annotations

import torch

from draftinfer.files.errors import ConfigError
from draftinfer.registry import FAMILIES, drafter_spec
from drafttrain.kinds.mtp.config import MTPTrainConfig
from drafttrain.kinds.mtp.objective import MTPObjective
from drafttrain.registry import InitContext, TrainSpec, register_train_kind


class MTPTrainSpec(TrainSpec):
    name = "mtp"
    config_class = MTPTrainConfig
    objective_class = MTPObjective
    # soft_ce: +0.007 AL over dpace on the mtp3 recipe (mean of seeds 0 and 1: 2.006 vs 1.999
    # at K=3; the order flips between seeds), docs/results.md "Losses on the zoo".
    default_loss = "soft_ce"

    def arch(self, cfg: MTPTrainConfig, ctx: InitContext):
        info, tc = ctx.target.info, ctx.target.config
        for field in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(cfg, field)
            if value is not None and value != getattr(tc, field, None):
                raise ConfigError(
                    f"MTP modules use the target's layer shapes: drafter.{field}={value} "
                    f"does not match the target's {getattr(tc, field, None)}"
                )
        target_config = {k: v for k, v in tc.to_dict().items() if k not in ("drafttrain",)}
        if not target_config.get("architectures"):  # a text config inside a multimodal one
            target_config["architectures"] = [info.architecture]
        return drafter_spec(self.name).config_class(
            n_predict=cfg.n_predict,
            target_config=target_config,
            mtp_feature_tap=cfg.mtp_feature_tap,
            mtp_chain=cfg.mtp_chain,
            mtp_carry=cfg.mtp_carry,
            mask_pos0_embedding=(
                cfg.layout == "deepseek"
                if cfg.mask_pos0_embedding is None
                else cfg.mask_pos0_embedding
            ),
            block="native" if _runner_block(info.architecture) else "hf",
            layout=cfg.layout,
        )

    def features(self, cfg: MTPTrainConfig, ctx: InitContext):
        return self.arch(cfg, ctx).features

    def blocks(self, drafter):
        """Each module's decoder block (the module's norms and `eh_proj` stay outside)."""
        return [layer.block for layer in drafter.layers]

    @torch.no_grad()
    def init_drafter(self, cfg: MTPTrainConfig, ctx: InitContext):
        spec = drafter_spec(self.name)
        drafter = spec.build(self.arch(cfg, ctx))
        shared = ctx.target.shared_weights()
        spec.attach_shared(drafter, {k: v.float() for k, v in shared.items()})
        if cfg.init == "target_last_layer":
            last = ctx.target.layers[-1].state_dict()
            norm = ctx.target.final_norm_weight()
            H = drafter.config.hidden_size
            # Columns of eh_proj that read the carried hidden state (the concat order).
            hid, emb = (slice(0, H), slice(H, None))
            if not drafter.config.hidden_first:
                hid, emb = emb, hid
            for k, layer in enumerate(drafter.layers):
                layer.block.load_state_dict({k: v.float() for k, v in last.items()})
                if norm is not None:
                    drafter.final_norm(k).weight.copy_(norm.float())
                w = torch.zeros(H, 2 * H)
                w[:, emb].normal_(0.0, 0.02)
                w[:, hid] = torch.eye(H)  # start from the (normed) carried hidden state
                layer.eh_proj.weight.copy_(w)
        return drafter


register_train_kind(MTPTrainSpec())

__all__ = ["MTPObjective", "MTPTrainConfig", "MTPTrainSpec"]


def _runner_block(architecture: str) -> bool:
    """Whether the runner builds MTP blocks for this target natively: its family is native and
    provides a drafter block (the dense Llama block, or the family's own native layer); else
    each block is the target's own transformers layer."""
    if not FAMILIES.is_native(architecture):
        return False
    return "drafter_block" in FAMILIES.for_architectures([architecture]).provides
