"""The GLM-4.7-Flash target family on the training side: transformers' own
`Glm4MoeLiteForCausalLM` (DeepSeek-V3's MLA, group-limited sigmoid routing with the correction
bias, shared experts, dense first layers) behind the text target interface. It trains like any
causal LM (the tokenizer's own chat template); the family exists so that the runner's native
model (`draftinfer/families/glm4_moe_lite/`) and the training side name the same family, and so
its drafters' model cards state what they were trained on.

The taps are read from the residual stream entering each decoder layer (convention 2), the
same for the dense first layers and the MoE ones; the frozen target's features equal the
native target's (`tests/families/test_glm4_moe_lite_train.py`). The checkpoint's own MTP layer
(`model.layers.47`) is not used here yet (issue 48, the `mtp` kind on this family).
"""

from __future__ import annotations

from drafttrain.families.causal_lm import CausalLMTrainFamily
from drafttrain.registry import register_train_family


class Glm4MoeLiteTrainFamily(CausalLMTrainFamily):
    name = "glm4_moe_lite"

    def card_notes(self, spec, arch) -> list[str]:
        if "layer_inputs" not in spec.needs:
            return []
        return [
            "Target family GLM-4.7-Flash (glm4_moe_lite): target taps are layer inputs (the "
            "residual stream entering a decoder layer, vLLM's reading of EAGLE-3 aux ids), the "
            "same for the dense first layers and the MoE layers."
        ]


register_train_family(Glm4MoeLiteTrainFamily())
