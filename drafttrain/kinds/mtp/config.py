"""Training config of the multi-layer MTP kind (`drafter: mtp` in the config tree)."""

from __future__ import annotations

from dataclasses import dataclass

from drafttrain.config import DrafterTrainConfig


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
    # Zero the token embedding at RoPE position 0, as vLLM's DeepSeek MTP layer does.
    mask_pos0_embedding: bool = True
    # "target_last_layer": each module's block starts as a copy of the target's last decoder
    # layer, its final norm as the target's, eh_proj as [small noise | identity]; "random".
    init: str = "target_last_layer"
    # Loss weight of module k: "uniform" (1) or "geometric" (loss_decay^k).
    loss_weights: str = "geometric"
    loss_decay: float = 0.8
