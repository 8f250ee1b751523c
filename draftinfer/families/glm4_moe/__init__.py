"""The GLM-4.5/4.6/4.7 target family (GQA with partial rotary and the checkpoint's q/k-norm
setting; DeepSeek-V3's group-limited sigmoid routing with the correction bias, shared experts,
dense first layers): the native model (`model.py`) and the family's registration. Text prompts
render through the tokenizer's chat template, as for any text target; drafters get the
layer-input taps and the final hidden state, MTP modules this family's own layer as their
block, and the checkpoint's own MTP layer is served as released (`drafter=native`,
`released_mtp`)."""

from __future__ import annotations

from draftinfer.families.glm4_moe.model import FAMILY, Glm4MoeForCausalLM
from draftinfer.registry import FamilySpec, register_family


class Glm4MoeFamily(FamilySpec):
    name = FAMILY
    models = {"Glm4MoeForCausalLM": Glm4MoeForCausalLM}
    # The residual-stream taps, the final hidden state and drafter_block (an MTP module's block
    # is this family's own native layer at index L + k, `decoder_layer`: GQA with partial
    # rotary and the checkpoint's q/k norm, the routed MLP), named rather than "all but" so
    # that a capability added to the vocabulary is not claimed by default. Not
    # dense_decoder_layer (its layers route tokens to experts and rotate half of each head).
    provides = frozenset({"layer_inputs", "final_hidden", "drafter_block"})
    # GLM-4.5/4.6/4.7's own MTP layer, `model.layers.{L+k}.*` (92 in GLM-4.5, 46 in -Air;
    # `num_nextn_predict_layers`, transformers' `Glm4MoeConfig.num_mtp_layers`), served as
    # vLLM's `glm4_moe_mtp.py` runs it: DeepSeek's MTP layer around GLM's decoder layer
    # (module 0 reads the target's post-final-norm hidden state, a module hands its
    # pre-`shared_head.norm` output on, `step % N` for K > N, the embedding at position 0
    # zeroed, `eh_proj(cat[enorm(emb), hnorm(h)])`).
    released_mtp = {
        "count_key": "num_nextn_predict_layers",
        "layout": "deepseek",
        "mtp_feature_tap": "post_norm",
        "mtp_chain": True,
        "mtp_carry": "pre_norm",
        "mask_pos0_embedding": True,
    }


register_family(Glm4MoeFamily())

__all__ = ["Glm4MoeFamily", "Glm4MoeForCausalLM"]
