"""The GLM-4.5/4.6/4.7 target family (GQA with partial rotary and the checkpoint's q/k-norm
setting; DeepSeek-V3's group-limited sigmoid routing with the correction bias, shared experts,
dense first layers): the native model (`model.py`) and the family's registration. Text prompts
render through the tokenizer's chat template, as for any text target; drafters get the
layer-input taps and the final hidden state."""

from __future__ import annotations

from draftinfer.families.glm4_moe.model import FAMILY, Glm4MoeForCausalLM
from draftinfer.registry import FamilySpec, register_family


class Glm4MoeFamily(FamilySpec):
    name = FAMILY
    models = {"Glm4MoeForCausalLM": Glm4MoeForCausalLM}
    # The residual-stream taps and the final hidden state, named rather than "all but" so
    # that a capability added to the vocabulary is not claimed by default. Not
    # dense_decoder_layer (its layers route tokens to experts and rotate half of each head),
    # and no MTP module runs this family's layers as its block yet (issue 48: the mtp
    # kind on GLM).
    provides = frozenset({"layer_inputs", "final_hidden"})


register_family(Glm4MoeFamily())

__all__ = ["Glm4MoeFamily", "Glm4MoeForCausalLM"]
