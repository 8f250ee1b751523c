"""Training config of the block-drafter kind (`drafter: dflash` in the config tree)."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafttrain.jobs.config import DrafterTrainConfig, above, at_least, one_of

# The paper's decay per block size (DFlash, arXiv 2602.06036; NeMo dflash.mdx).
LOSSES = ("ce", "kl")
WEIGHTS = ("exp_decay", "dpace", "uniform")
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class DFlashTrainConfig(DrafterTrainConfig):
    kind: str = "dflash"
    num_layers: int = 5
    # Slots per block: the anchor + block_size - 1 mask slots (drafts per round at most).
    block_size: int = 16
    # Target layers read, in DFlash's semantics ("output of layer t", what the checkpoint's
    # `dflash_config.target_layer_ids` holds). Empty: z-lab's build_target_layer_ids(L,
    # num_layers), e.g. [1, 9, 17, 25, 33] for Qwen3-8B.
    target_layer_ids: list[int] = field(default_factory=list)
    # The mask slots' token: null = the first embedding row past the tokenizer, else its pad
    # token when that is not EOS (NeMo: pad often aliases EOS; a reused EOS is refused).
    mask_token_id: int | None = None
    # Anchors per sequence (drawn without replacement from the assistant tokens whose next
    # token is an assistant token too; every block in one forward).
    num_anchors: int = 512
    # "ce": soft cross-entropy against the target's distribution; "kl": forward KL at
    # kd_temperature, T^2-scaled (JetSpec).
    loss: str = "ce"
    kd_temperature: float = 1.0
    # Per-slot weights: "exp_decay" (exp(-(k-1)/gamma)), "dpace" (D-PACE, dpace_alpha),
    # "uniform" (JetSpec).
    loss_weights: str = "exp_decay"
    gamma: float | None = None  # null: the paper's for block_size 16 / 10 / 8
    dpace_alpha: float = 0.5
    # JetSpec: causal attention inside the block (exported as dflash_config.causal).
    causal_block: bool = False
    # Per layer "full_attention" / "sliding_attention" (empty: all full).
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    # DFlash2: the grouped dynamic causal conv and the candidate selector (both, as the
    # published DFlash2DraftModel has them).
    dflash2: bool = False
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_top_k: int = 16
    selector_rank: int = 256
    selector_loss_weight: float = 1.0
    # DSpark (REFERENCES A1/A2): the anchor slot drafts too (`sample_from_anchor`), a low-rank
    # Markov head (`markov_rank`, `markov_head_type`) and the confidence head; the loss per
    # drafting slot is `dspark_ce_weight * CE + dspark_tv_weight * TV + confidence_loss_weight
    # * BCE(confidence, sum min(p_draft, p_target))` under the per-slot weights (exp_decay:
    # exp(-(j-1)/gamma) for draft j, DSpark's exp(-k/gamma) of anchor-slot index k).
    # `markov_head_type: gated` (speculators 0.9.0's definition, `draftinfer.kinds.dflash.module`)
    # trains and runs here, but no engine serves it: the z-lab / vLLM export refuses it, only
    # the speculators `dspark` layout holds it. `confidence_head_with_markov`: the confidence
    # head reads `[h, markov_w1[prev]]` (H + r) instead of h.
    dspark: bool = False
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head_with_markov: bool = False
    dspark_ce_weight: float = 0.1
    dspark_tv_weight: float = 0.9
    confidence_loss_weight: float = 1.0
    # LiLiCorr (arXiv 2608.20530; ModelOpt #2342's `projector_type: lilicorr`): a two-layer
    # transformer correlator over the block's slots scores transitions between adjacent slots'
    # top-k candidates, drafts walk the lattice from the anchor. `lilicorr_conv` adds DFlash2's
    # grouped conv (conv_kernel_size / conv_group_size) without its selector (the published
    # "LiLiCorr + conv"). The lattice loss: `lilicorr_loss_weight x` a K-way cross-entropy over
    # the draft's top-K (the target's top-1 inserted when missing) scored from the ground-truth
    # predecessor `x_{a+k-1}`, under the same per-slot weights (as DFlash2's selector CE).
    lilicorr: bool = False
    lilicorr_conv: bool = False
    lilicorr_top_k: int = 16
    lilicorr_rank: int = 64
    lilicorr_layers: int = 2
    lilicorr_heads: int = 4
    lilicorr_loss_weight: float = 1.0

    def check(self) -> None:
        super().check()
        at_least("drafter", self, 2, "block_size")
        at_least("drafter", self, 1, "num_anchors", "conv_kernel_size", "conv_group_size")
        at_least("drafter", self, 1, "selector_top_k", "selector_rank", "sliding_window")
        above("drafter", self, 0, "kd_temperature", "gamma")
        at_least("drafter", self, 0, "selector_loss_weight", "dpace_alpha")
        at_least("drafter", self, 1, "markov_rank")
        at_least("drafter", self, 0, "dspark_ce_weight", "dspark_tv_weight")
        at_least("drafter", self, 0, "confidence_loss_weight")
        one_of("drafter", self, "markov_head_type", ("vanilla", "gated"))
        at_least("drafter", self, 1, "lilicorr_top_k", "lilicorr_rank", "lilicorr_layers")
        at_least("drafter", self, 1, "lilicorr_heads")
        at_least("drafter", self, 0, "lilicorr_loss_weight")
        if self.lilicorr and (self.dflash2 or self.dspark):
            from drafttrain.jobs.errors import ConfigError

            raise ConfigError(
                "drafter.lilicorr re-ranks the drafts through its own lattice: keep "
                "drafter.dflash2=false and drafter.dspark=false (lilicorr_conv adds DFlash2's conv)"
            )
        if self.lilicorr_conv and not self.lilicorr:
            from drafttrain.jobs.errors import ConfigError

            raise ConfigError("drafter.lilicorr_conv needs drafter.lilicorr=true")
        if self.dspark and (self.dflash2 or self.loss != "ce"):
            from drafttrain.jobs.errors import ConfigError

            raise ConfigError(
                "drafter.dspark: its own loss (CE + TV + BCE) with the anchor-slot layout; "
                "keep drafter.dflash2=false and drafter.loss=ce"
            )
        one_of("drafter", self, "loss", LOSSES)
        one_of("drafter", self, "loss_weights", WEIGHTS)
