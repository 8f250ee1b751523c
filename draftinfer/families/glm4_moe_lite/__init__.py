"""The GLM-4.7-Flash target family (`glm4_moe_lite`: DeepSeek-V3's MLA over a latent cache,
group-limited sigmoid routing with the correction bias, shared experts, dense first layers
listed by `mlp_layer_types`): the native model (`model.py`) and the family's registration.
Text prompts render through the tokenizer's chat template, as for any text target; drafters
get the layer-input taps and the final hidden state."""

from __future__ import annotations

from draftinfer.families.glm4_moe_lite.model import FAMILY, Glm4MoeLiteForCausalLM
from draftinfer.registry import FamilySpec, register_family


class Glm4MoeLiteFamily(FamilySpec):
    name = FAMILY
    models = {"Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM}
    # The residual-stream taps and the final hidden state, named rather than "all but" so
    # that a capability added to the vocabulary is not claimed by default. Not
    # dense_decoder_layer (its layers attend through MLA and route tokens to experts), and
    # no MTP module runs this family's layers as its block yet (issue 48: the mtp
    # kind on GLM).
    provides = frozenset({"layer_inputs", "final_hidden"})


register_family(Glm4MoeLiteFamily())

__all__ = ["Glm4MoeLiteFamily", "Glm4MoeLiteForCausalLM"]
