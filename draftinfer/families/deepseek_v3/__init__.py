"""The DeepSeek-V3 target family (MLA with a latent KV cache, group-limited sigmoid routing
with the correction bias, shared experts, dense first layers): the native model (`model.py`)
and the family's registration. Text prompts render through the tokenizer's chat template, as
for any text target; drafters get the layer-input taps and the final hidden state."""

from __future__ import annotations

from draftinfer.families.deepseek_v3.model import FAMILY, DeepseekV3ForCausalLM
from draftinfer.registry import FEATURES, FamilySpec, register_family


class DeepseekV3Family(FamilySpec):
    name = FAMILY
    models = {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}
    # layer_inputs (residual stream taps), final_hidden; not dense_decoder_layer: its layers
    # attend through MLA and route tokens to experts, which no MTP module (a dense Llama
    # block here) can mirror yet.
    provides = FEATURES - {"dense_decoder_layer"}


register_family(DeepseekV3Family())

__all__ = ["DeepseekV3Family", "DeepseekV3ForCausalLM"]
