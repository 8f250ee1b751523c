"""The Qwen3-MoE target family (routed experts, softmax-then-top-k routing, dense
`mlp_only_layers`): the native model (`model.py`) and the family's registration. Text prompts
render through the tokenizer's chat template, as for any text target; drafters get the
layer-input taps and the final hidden state."""

from __future__ import annotations

from draftinfer.families.qwen3_moe.model import FAMILY, Qwen3MoeForCausalLM
from draftinfer.registry import FEATURES, FamilySpec, register_family


class Qwen3MoeFamily(FamilySpec):
    name = FAMILY
    models = {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}
    # layer_inputs (residual stream taps), final_hidden; not dense_decoder_layer: its layers
    # route tokens to experts, which no MTP module (a dense block here) can mirror yet.
    # Nor drafter_block: the MTP kind does not run its routed layers as a module's block yet.
    provides = FEATURES - {"dense_decoder_layer", "drafter_block"}


register_family(Qwen3MoeFamily())

__all__ = ["Qwen3MoeFamily", "Qwen3MoeForCausalLM"]
