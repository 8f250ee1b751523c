"""Training config of the multi-layer MTP kind (`drafter: mtp` in the config tree)."""

from __future__ import annotations

from dataclasses import dataclass

from drafttrain.jobs.config import DrafterTrainConfig, above, at_least, one_of

INITS = ("target_last_layer", "random", "native", "native_all")


@dataclass
class MTPTrainConfig(DrafterTrainConfig):
    kind: str = "mtp"
    # N distinct modules; module k drafts token k+1 (convention 10).
    n_predict: int = 3
    # Convention 5: which target final hidden feeds module 0, whether module k+1 consumes
    # module k's output, and which of module k's outputs is carried.
    mtp_feature_tap: str = "post_norm"
    mtp_chain: bool = True
    mtp_carry: str = "pre_norm"
    # Checkpoint layout and its serving semantics (`draftinfer/kinds/mtp/config.py`):
    # "deepseek" or "mrv2" (vLLM Model Runner V2's multi-module contract, Inkling's layout).
    layout: str = "deepseek"
    # Zero the token embedding at RoPE position 0, as vLLM's DeepSeek MTP layer does; null:
    # the layout's own (deepseek: true, mrv2: false).
    mask_pos0_embedding: bool | None = None
    # "target_last_layer": each module's block starts as a copy of the target's last decoder
    # layer, its final norm as the target's, eh_proj as [small noise | identity]; "random";
    # "native": module 0 is the MTP layer the target ships in its own files (DeepSeek-V3's
    # `model.layers.{L}.*`; `drafter=native` in the runner serves it as released), the others
    # as target_last_layer; "native_all": module k is the target's layer k % (its count).
    init: str = "target_last_layer"
    # Loss weight of module k: "uniform" (1) or "geometric" (loss_decay^k).
    loss_weights: str = "geometric"
    loss_decay: float = 0.8
    # Chained modules: stop module k+1's loss from reaching module k through the carried
    # hidden state (each module then trains on its own loss only; the forward is unchanged).
    detach_carry: bool = False

    def check(self) -> None:
        super().check()
        at_least("drafter", self, 1, "n_predict")
        above("drafter", self, 0, "loss_decay")
        one_of("drafter", self, "mtp_feature_tap", ("pre_norm", "post_norm"))
        one_of("drafter", self, "mtp_carry", ("pre_norm", "post_norm"))
        one_of("drafter", self, "init", INITS)
        one_of("drafter", self, "loss_weights", ("uniform", "geometric"))
