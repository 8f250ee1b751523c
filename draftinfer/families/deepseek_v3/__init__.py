"""The DeepSeek-V3 target family (MLA with a latent KV cache, group-limited sigmoid routing
with the correction bias, shared experts, dense first layers): the native model (`model.py`)
and the family's registration. Text prompts render through the tokenizer's chat template, as
for any text target; drafters get the layer-input taps and the final hidden state, MTP modules
this family's own layer as their block, and the checkpoint's own MTP layers are served as
released (`drafter=native`, `released_mtp`)."""

from __future__ import annotations

from draftinfer.families.deepseek_v3.model import FAMILY, DeepseekV3ForCausalLM
from draftinfer.registry import FEATURES, FamilySpec, register_family


class DeepseekV3Family(FamilySpec):
    name = FAMILY
    models = {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}
    # layer_inputs (residual stream taps), final_hidden, drafter_block (an MTP module's block
    # is this family's own native layer, MLA with its latent cache and the routed or dense MLP
    # of its index, `DeepseekV3ForCausalLM.decoder_layer`); not dense_decoder_layer: its
    # layers attend through MLA and route tokens to experts.
    provides = FEATURES - {"dense_decoder_layer"}
    # DeepSeek-V3's own MTP layers, `model.layers.{L+k}.*` (REFERENCES part D, C4), served as
    # vLLM's `deepseek_mtp.py` runs them: module 0 reads the target's post-final-norm hidden
    # state, a module hands its pre-`shared_head.norm` output on (reused for K > N, `step %
    # N`), the embedding at position 0 is zeroed, `eh_proj(cat[enorm(emb), hnorm(h)])`.
    released_mtp = {
        "count_key": "num_nextn_predict_layers",
        "layout": "deepseek",
        "mtp_feature_tap": "post_norm",
        "mtp_chain": True,
        "mtp_carry": "pre_norm",
        "mask_pos0_embedding": True,
    }


register_family(DeepseekV3Family())

__all__ = ["DeepseekV3Family", "DeepseekV3ForCausalLM"]
