"""The GLM-4.7-Flash target family (`glm4_moe_lite`: DeepSeek-V3's MLA over a latent cache,
group-limited sigmoid routing with the correction bias, shared experts, dense first layers
listed by `mlp_layer_types`): the native model (`model.py`) and the family's registration.
Text prompts render through the tokenizer's chat template, as for any text target; drafters
get the layer-input taps and the final hidden state, MTP modules this family's own layer (the
DeepSeek-V3 layer: MLA, routed experts) as their block, and the checkpoint's own MTP layer is
served as released (`drafter=native`, `released_mtp`)."""

from __future__ import annotations

from draftinfer.families.glm4_moe_lite.model import FAMILY, Glm4MoeLiteForCausalLM
from draftinfer.registry import FamilySpec, register_family


class Glm4MoeLiteFamily(FamilySpec):
    name = FAMILY
    models = {"Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM}
    # The residual-stream taps, the final hidden state and drafter_block (an MTP module's block
    # is this family's own native layer at index L + k, `decoder_layer`: MLA with its latent
    # cache and the routed MLP), named rather than "all but" so that a capability added to the
    # vocabulary is not claimed by default. Not dense_decoder_layer (its layers attend
    # through MLA and route tokens to experts).
    provides = frozenset({"layer_inputs", "final_hidden", "drafter_block"})
    # GLM-4.7-Flash's own MTP layer, `model.layers.47.*` (`model.layers.{L+k}`, counted by
    # `num_nextn_predict_layers` in the released config.json; transformers'
    # `Glm4MoeLiteConfig` has no field for it and keeps the key as an extra attribute),
    # served as vLLM's `glm4_moe_lite_mtp.py` runs it: DeepSeek's MTP layer (module 0 reads
    # the target's post-final-norm hidden state, a module hands its pre-`shared_head.norm`
    # output on, `step % N` for K > N, the embedding at position 0 zeroed,
    # `eh_proj(cat[enorm(emb), hnorm(h)])`).
    released_mtp = {
        "count_key": "num_nextn_predict_layers",
        "layout": "deepseek",
        "mtp_feature_tap": "post_norm",
        "mtp_chain": True,
        "mtp_carry": "pre_norm",
        "mask_pos0_embedding": True,
    }


register_family(Glm4MoeLiteFamily())

__all__ = ["Glm4MoeLiteFamily", "Glm4MoeLiteForCausalLM"]
