"""Native GLM-4.5/4.6/4.7 target (transformers' `Glm4MoeForCausalLM`; GLM-4.5, GLM-4.5-Air,
GLM-4.6, GLM-4.7 and smaller configs of the same architecture): the shared decoder with this
family's layers.

    model = load_native_target("path/to/glm-4.5-air", "cuda", torch.bfloat16, 8, 4096)

What differs from the dense Llama block (REFERENCES part D, D; HF `modeling_glm4_moe.py`):
- attention: GQA (`CachedAttention`) with biases on q/k/v only (`attention_bias`; `o_proj` has
  none), the per-head q/k RMSNorm before RoPE where the checkpoint sets `use_qk_norm`
  (GLM-4.5/4.6 do not; check each checkpoint), and **partial rotary**: RoPE (NeoX halves) on the
  first `int(head_dim * partial_rotary_factor)` dimensions of each head only (0.5 in the
  released models and transformers' default), the rest unrotated (`NativeConfig.rotary_dim`,
  `rope.apply_rope` on a narrower table); `head_dim` is the config's, not `hidden / heads`
  (GLM-4.5: 128 with hidden 5120 and 96 heads);
- MLP: DeepSeek-V3's routed block (`draftinfer.models.grouped_moe`): the first
  `first_k_dense_replace` layers dense SwiGLUs of `intermediate_size`, the others
  `GroupedSigmoidRouter` at `mlp.gate` (sigmoid scores, `e_score_correction_bias` only
  selecting, `n_group` / `topk_group` group limit, renormalised with `norm_topk_prob`, times
  `routed_scaling_factor`; fp32), experts at `mlp.experts` (`[E, 2I, H]`, `SiluGLU`) and
  `mlp.shared_experts`.

Checkpoints: one tensor per expert, `mlp.experts.{e}.{gate,up,down}_proj.weight`, as the
released files and HF's `save_pretrained` store them (`Experts.per_expert_sources`); the
stacked layout loads by name. The MTP layer the released checkpoints carry past the last layer
(`model.layers.{L}`: 92 in GLM-4.5, 46 in -Air; `num_nextn_predict_layers`) belongs to a drafter
and is skipped here. Not served (one-line `ConfigError`s): quantized files
(`quantization_config`, e.g. GLM-4.5-FP8; dequantize to bf16 first), no routed or no shared
experts, groups that do not split the experts, sliding windows.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from draftinfer.models.decoder import DecoderLayer, NativeCausalLM, NativeConfig, TensorSource
from draftinfer.models.grouped_moe import (
    GroupedMoEFields,
    grouped_moe_fields,
    grouped_moe_mlp,
    refuse_quantized,
    stacked_expert_sources,
)

FAMILY = "glm4_moe"


@dataclass
class Glm4MoeNativeConfig(NativeConfig, GroupedMoEFields):
    """`NativeConfig` (`rotary_dim` the rotated part of a head, `qk_norm` the checkpoint's
    `use_qk_norm`, `intermediate_size` the dense layers') plus the routed experts
    (`draftinfer.models.grouped_moe`)."""


class Glm4MoeForCausalLM(NativeCausalLM):
    """GLM-4.5 / 4.6 / 4.7 (and -Air)."""

    hf_model_types = ("glm4_moe",)
    family = FAMILY
    partial_rotary = True

    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> Glm4MoeNativeConfig:
        name = cls.__name__
        refuse_quantized(hf, name)
        moe = grouped_moe_fields(hf, name)
        # NativeCausalLM's rule: sizes, heads, the rope (partial rotary read here,
        # `partial_rotary`), no sliding windows.
        base = super().config_from_hf(hf, eos_token_ids)
        fields = {f: getattr(base, f) for f in NativeConfig.__dataclass_fields__}
        fields["qk_norm"] = bool(getattr(hf, "use_qk_norm", False))
        return Glm4MoeNativeConfig(**fields, **moe)

    @classmethod
    def block_flags(cls, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool, bool]:
        # `attention_bias` biases q/k/v, never o_proj (HF `Glm4MoeAttention`); the q/k norm is
        # the config's `use_qk_norm` (`config_from_hf`).
        return attention_bias, False, False, False

    @classmethod
    def decoder_layer(cls, cfg: Glm4MoeNativeConfig, index: int) -> nn.Module:
        mlp = grouped_moe_mlp(cfg, index)  # dense first layers, then routed + shared experts
        return DecoderLayer(cfg, mlp=mlp, norm=partial(cls.rms_norm, cfg))

    def checkpoint_sources(
        self, param: str, available: Container[str]
    ) -> list[TensorSource] | None:
        """The stacked expert parameters from the per-expert tensors HF saves
        (`Experts.per_expert_sources`)."""
        return stacked_expert_sources(self, param)
