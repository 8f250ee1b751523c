"""The gpt-oss target family (sinks, alternating sliding windows, routed experts, MXFP4
checkpoints): the native model (`model.py`), the MXFP4 dequantizer (`mxfp4.py`) and the
family's registration. Text prompts render through the tokenizer's (Harmony) chat template,
as for any text target; drafters get the layer-input taps and the final hidden state."""

from __future__ import annotations

from draftinfer.families.gpt_oss.model import FAMILY, GptOssForCausalLM
from draftinfer.registry import FEATURES, FamilySpec, register_family


class GptOssFamily(FamilySpec):
    name = FAMILY
    models = {"GptOssForCausalLM": GptOssForCausalLM}
    # layer_inputs (residual stream taps), final_hidden; not dense_decoder_layer: its layers
    # route tokens to experts, which no MTP module (a dense block here) can mirror yet.
    # Nor drafter_block: the MTP kind does not run its routed layers as a module's block yet.
    provides = FEATURES - {"dense_decoder_layer", "drafter_block"}


register_family(GptOssFamily())

__all__ = ["GptOssFamily", "GptOssForCausalLM"]
