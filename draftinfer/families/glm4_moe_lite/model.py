"""Native GLM-4.7-Flash target (transformers' `Glm4MoeLiteForCausalLM`, model type
`glm4_moe_lite`): DeepSeek-V3's decoder under GLM's name, so the native model is the
`deepseek_v3` family's (`draftinfer.families.deepseek_v3.model`) with this family's name.

    model = load_native_target("path/to/glm-4.7-flash", "cuda", torch.bfloat16, 8, 4096)

transformers builds the architecture from DeepSeek-V3's pieces (HF `modular_glm4_moe_lite.py`:
`Glm4MoeLiteAttention(DeepseekV3Attention)`, the router, experts and shared experts of
`glm4_moe`, which are DeepSeek-V3's computation; REFERENCES part D, D):
- attention: MLA over the latent cache (`draftinfer.models.mla.LatentAttention`): low-rank
  query (`q_lora_rank` 768), the compressed KV (`kv_lora_rank` 512) plus the decoupled RoPE key
  (`qk_rope_head_dim` 64) cached as the latent, 576 values per token per layer at GLM-4.7-Flash's
  sizes; interleaved RoPE (`rope_interleave`) on the rope slice only, whole (a
  `partial_rotary_factor` below 1 is refused: HF's MLA rotates the whole slice); YaRN's
  `mscale_all_dim` in the softmax scale where the rope is scaled;
- MLP (`draftinfer.models.grouped_moe`): the config lists each layer's kind in
  `mlp_layer_types` (`"dense"` first, GLM-4.7-Flash: one dense layer) where DeepSeek-V3 has
  `first_k_dense_replace`; other patterns are refused in one line. Sigmoid routing with the
  correction bias and the group limit, `routed_scaling_factor` (1.8 released), shared experts.

Checkpoints: one tensor per expert (`mlp.experts.{e}.*_proj.weight`); the MTP layer the released
checkpoint carries at `model.layers.47` (`num_nextn_predict_layers`) belongs to a drafter and is
skipped. Not served: what the DeepSeek-V3 family refuses (quantized files, `num_key_value_heads
!= num_attention_heads`, no shared expert, groups that do not split the experts).
"""

from __future__ import annotations

from draftinfer.families.deepseek_v3.model import DeepseekV3ForCausalLM

FAMILY = "glm4_moe_lite"


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash (and smaller configs of the same architecture)."""

    hf_model_types = ("glm4_moe_lite",)
    family = FAMILY
