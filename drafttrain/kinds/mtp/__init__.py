"""Training side of the multi-layer MTP kind: config, objective and initialisation from the
target, registered as `mtp`. The block of each module is the target family's decoder layer:
the native `DecoderLayer` (shared with the runner) for Llama / Qwen2 / Qwen3 targets, the
family's own native layer where the runner has one (DeepSeek-V3: MLA with its latent cache,
routed experts), the family's own transformers class otherwise (trainable against any HF
causal LM; served by engines). `init=native` starts module 0 (`native_all`: every module) from
the MTP layers the target ships in its own files (`draftinfer.kinds.mtp.released`)."""

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
        if cfg.init in ("target_last_layer", "native"):
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
        if cfg.init in ("native", "native_all"):
            self._init_from_released(drafter, cfg, ctx)
        return drafter

    def _init_from_released(self, drafter, cfg: MTPTrainConfig, ctx: InitContext) -> None:
        """Module 0 (`native`) or every module (`native_all`: module k from released layer
        k % n) copied from the MTP layers the target ships in its own files: each module's
        norms, `eh_proj`, final norm and block, checked by name and shape."""
        from draftinfer.kinds.mtp.released import released_layers

        c = drafter.config
        target_cfg = getattr(ctx.target, "cfg", None)
        if target_cfg is None:
            raise ConfigError("drafter.init=native reads the target's files: no target path")
        if c.layout != "deepseek" or not (c.block == "native" and c.own_layer):
            raise ConfigError(
                f"drafter.init={cfg.init} copies the target's own MTP layers: it needs layout "
                f"deepseek and the family's own layer as block (got layout {c.layout}, block "
                f"{c.block})"
            )
        arch, released = released_layers(target_cfg.name_or_path, self.name)
        n = arch.n_predict
        state = drafter.state_dict()
        modules = range(c.n_predict) if cfg.init == "native_all" else range(1)
        for k in modules:
            src = f"layers.{k % n}."
            for name, t in released.items():
                if not name.startswith(src):
                    continue
                ours = f"layers.{k}." + name[len(src) :]
                if ours not in state or state[ours].shape != t.shape:
                    have = None if ours not in state else tuple(state[ours].shape)
                    raise ConfigError(
                        f"drafter.init={cfg.init}: the target's MTP tensor {name} "
                        f"{tuple(t.shape)} does not fit the drafter's {ours} ({have})"
                    )
                state[ours].copy_(t.to(state[ours].dtype))


register_train_kind(MTPTrainSpec())

__all__ = ["MTPObjective", "MTPTrainConfig", "MTPTrainSpec"]


def _runner_block(architecture: str) -> bool:
    """Whether the runner builds MTP blocks for this target natively: its family is native and
    provides a drafter block (the dense Llama block, or the family's own native layer); else
    each block is the target's own transformers layer."""
    if not FAMILIES.is_native(architecture):
        return False
    return "drafter_block" in FAMILIES.for_architectures([architecture]).provides
