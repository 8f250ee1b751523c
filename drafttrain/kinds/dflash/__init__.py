"""Training side of the block-drafter kind: config, objective and the architecture derived
from the target, registered as `dflash`."""

from __future__ import annotations

import torch

from draftinfer.kinds.dflash.taps import check_dflash_ids, default_dflash_ids, tap_of_dflash_id
from draftinfer.models.rope import rope_from_hf
from draftinfer.registry import drafter_spec
from drafttrain.jobs.errors import ConfigError
from drafttrain.kinds.dflash.config import DFlashTrainConfig
from drafttrain.kinds.dflash.objective import DFlashObjective, resolve_gamma
from drafttrain.registry import InitContext, TrainSpec, register_train_kind


def mask_token(cfg: DFlashTrainConfig, vocab_size: int, tokenizer) -> int:
    """`cfg.mask_token_id`, else the first embedding row past the tokenizer (Qwen3: 151669,
    as z-lab's checkpoints), else the tokenizer's pad token when it is not EOS."""
    if cfg.mask_token_id is not None:
        return int(cfg.mask_token_id)
    if tokenizer is not None:
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        if pad is not None and pad != eos:
            return int(pad)
    raise ConfigError(
        "drafter.mask_token_id: the target has no spare embedding row and no pad token distinct "
        "from EOS; set a reserved token id"
    )


# The architecture fields DSpark adds to a DFlash drafter (`warm_start_heads`).
DSPARK_FIELDS = (
    "sample_from_anchor",
    "markov_rank",
    "markov_head_type",
    "confidence_head",
    "confidence_head_with_markov",
)


class DFlashTrainSpec(TrainSpec):
    name = "dflash"
    config_class = DFlashTrainConfig
    objective_class = DFlashObjective
    # D-PACE per block slot: +0.040 AL over soft_ce with exp-decay weights on the zoo (mean of
    # seeds 0 and 1: 1.696 vs 1.656 at K=3; ahead on both), docs/results.md "Losses on the zoo".
    default_loss = "dpace"

    def warm_start_heads(self, saved: dict, arch: dict) -> tuple[str, ...]:
        """DSpark from a trained DFlash drafter (REFERENCES A1: DSpark's backbone is DFlash):
        the checkpoint has no Markov or confidence head, the two architectures differ only in
        DSpark's fields, so the backbone is loaded and the heads start at their init (the
        Markov head's `markov_w2` at zero: the start drafts as the DFlash drafter did, one slot
        later with `sample_from_anchor`)."""
        if saved.get("markov_rank") or saved.get("confidence_head"):
            return ()
        same = {k: v for k, v in saved.items() if k not in DSPARK_FIELDS}
        if same != {k: v for k, v in arch.items() if k not in DSPARK_FIELDS}:
            return ()
        return ("markov_head.", "confidence_head.")

    def arch(self, cfg: DFlashTrainConfig, ctx: InitContext):
        info, tc = ctx.target.info, ctx.target.config
        H, L = info.hidden_size, info.num_layers
        if (cfg.hidden_size or H) != H:
            raise ConfigError(
                f"drafter hidden_size {cfg.hidden_size} does not fit target hidden_size {H}: "
                "a block drafter embeds with the target's embedding and scores with its head"
            )
        if cfg.loss_weights == "exp_decay":
            resolve_gamma(cfg)
        ids = list(cfg.target_layer_ids) or default_dflash_ids(L, cfg.num_layers)
        ids = check_dflash_ids(ids, L, "drafter.target_layer_ids")
        heads = cfg.num_attention_heads or tc.num_attention_heads
        kv = cfg.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads
        head_dim = cfg.head_dim or getattr(tc, "head_dim", None) or H // tc.num_attention_heads
        theta, scaling = rope_from_hf(tc, head_dim)
        return drafter_spec(self.name).config_class(
            hidden_size=H,
            intermediate_size=cfg.intermediate_size or tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            vocab_size=info.vocab_size,
            num_target_layers=L,
            tap_layer_ids=[tap_of_dflash_id(t) for t in ids],
            num_hidden_layers=cfg.num_layers,
            block_size=cfg.block_size,
            mask_token_id=mask_token(cfg, info.vocab_size, ctx.tokenizer),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            # Never shorter than the target's: a short value corrupts RoPE in engines.
            max_position_embeddings=info.max_position_embeddings,
            layer_types=list(cfg.layer_types),
            sliding_window=cfg.sliding_window,
            causal_block=cfg.causal_block,
            conv_kernel_size=cfg.conv_kernel_size if cfg.dflash2 or cfg.lilicorr_conv else 0,
            conv_group_size=cfg.conv_group_size,
            selector_top_k=cfg.selector_top_k if cfg.dflash2 else 0,
            selector_rank=cfg.selector_rank,
            sample_from_anchor=cfg.dspark,
            markov_rank=cfg.markov_rank if cfg.dspark else 0,
            markov_head_type=cfg.markov_head_type,
            confidence_head=cfg.dspark,
            confidence_head_with_markov=cfg.dspark and cfg.confidence_head_with_markov,
            lilicorr_top_k=cfg.lilicorr_top_k if cfg.lilicorr else 0,
            lilicorr_rank=cfg.lilicorr_rank,
            lilicorr_layers=cfg.lilicorr_layers,
            lilicorr_heads=cfg.lilicorr_heads,
        )

    def features(self, cfg: DFlashTrainConfig, ctx: InitContext):
        return self.arch(cfg, ctx).features

    @torch.no_grad()
    def init_drafter(self, cfg: DFlashTrainConfig, ctx: InitContext):
        """Random layers (as the published recipes train them); the target's embedding and head
        attached (frozen); the final norm starts as the target's (its head reads it)."""
        spec = drafter_spec(self.name)
        drafter = spec.build(self.arch(cfg, ctx))
        shared = ctx.target.shared_weights()
        spec.attach_shared(drafter, {k: v.float() for k, v in shared.items()})
        norm = ctx.target.final_norm_weight()
        if norm is not None and norm.numel() == drafter.norm.weight.numel():
            drafter.norm.weight.copy_(norm.float())
        return drafter


register_train_kind(DFlashTrainSpec())

__all__ = ["DFlashObjective", "DFlashTrainConfig", "DFlashTrainSpec"]
