"""The GLM-4.5/4.6/4.7 target family on the training side: transformers' own
`Glm4MoeForCausalLM` (GQA with partial rotary and the checkpoint's q/k-norm setting,
DeepSeek-V3's group-limited sigmoid routing with the correction bias, shared experts, dense
first layers) behind the text target interface. It trains like any causal LM (the tokenizer's
own chat template); the family exists so that the runner's native GLM
(`draftinfer/families/glm4_moe/`) and the training side name the same family, and so its
drafters' model cards state what they were trained on.

The taps are read from the residual stream entering each decoder layer (convention 2), the
same for the dense first layers and the MoE ones; the frozen target's features equal the
native target's (`tests/families/test_glm4_moe_train.py`). A drafter keeps its own whole-head
RoPE with the target's frequencies (`partial_rotary_factor` is the target attention's, DESIGN
14). The checkpoint's own MTP layer (`model.layers.{L}`) is not used here yet (issue 48, the
`mtp` kind on this family).
"""

from __future__ import annotations

from drafttrain.families.causal_lm import CausalLMTrainFamily
from drafttrain.registry import register_train_family


class Glm4MoeTrainFamily(CausalLMTrainFamily):
    name = "glm4_moe"

    def card_notes(self, spec, arch) -> list[str]:
        if "layer_inputs" not in spec.needs:
            return []
        return [
            "Target family GLM-4.5/4.6 (glm4_moe): target taps are layer inputs (the residual "
            "stream entering a decoder layer, vLLM's reading of EAGLE-3 aux ids), the same for "
            "the dense first layers and the MoE layers; the drafter rotates whole heads with "
            "the target's RoPE frequencies (the target rotates half of each head)."
        ]


register_train_family(Glm4MoeTrainFamily())
