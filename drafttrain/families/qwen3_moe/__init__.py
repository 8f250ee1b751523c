"""The Qwen3-MoE target family on the training side: transformers' own `Qwen3MoeForCausalLM`
(qk-norm attention, softmax-then-top-k routing renormalised with `norm_topk_prob`, no shared
expert) behind the text target interface. It trains like any causal LM (SDPA attention,
the tokenizer's own Qwen3 chat template with its `<think>` block); the family exists so that
the runner's native Qwen3-MoE (`draftinfer/families/qwen3_moe/`) and the training side name
the same family, and so its drafters' model cards state what they were trained on.

The taps are read from the residual stream entering each decoder layer (convention 2), the
same for the MoE and the dense (`mlp_only_layers`) layers.
"""

from __future__ import annotations

from drafttrain.families.causal_lm import CausalLMTrainFamily
from drafttrain.registry import register_train_family


class Qwen3MoeTrainFamily(CausalLMTrainFamily):
    name = "qwen3_moe"

    def card_notes(self, spec, arch) -> list[str]:
        if "layer_inputs" not in spec.needs:
            return []
        return [
            "Target family Qwen3-MoE: target taps are layer inputs (the residual stream "
            "entering a decoder layer, vLLM's reading of EAGLE-3 aux ids), the same for MoE and "
            "dense layers."
        ]


register_train_family(Qwen3MoeTrainFamily())
