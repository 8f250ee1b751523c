"""Native DeepSeek-V3 target (transformers' `DeepseekV3ForCausalLM`; DeepSeek-V3/R1 and smaller
configs of the same architecture): the shared decoder with this family's layers.

    model = load_native_target("path/to/deepseek-v3-bf16", "cuda", torch.bfloat16, 8, 4096)

What differs from the dense Llama block (REFERENCES part D, C1-C3; HF `modeling_deepseek_v3.py`):
- attention: MLA (`draftinfer.models.mla.LatentAttention` at `self_attn`): low-rank query
  (`q_lora_rank`), the compressed KV `kv_lora_rank` plus the decoupled RoPE key cached as the
  latent (`kv_lora_rank + qk_rope_head_dim` values per token per layer, 576 at V3's sizes),
  RoPE on the `qk_rope_head_dim` slice only (interleaved pairs with `rope_interleave`), the
  softmax scale with YaRN's `mscale_all_dim` correction (`mla.mla_softmax_scale`); decode and
  verify run with `kv_b_proj` absorbed into the query and output side, prefill expands it;
- RoPE: the rotary's `head_dim` is `qk_rope_head_dim` (HF sets `head_dim` to it), YaRN with
  `mscale` / `mscale_all_dim` (`draftinfer.models.rope`);
- MLP: layers `< first_k_dense_replace` dense SwiGLU of `intermediate_size`; the others routed
  (`draftinfer.models.moe`): `GroupedSigmoidRouter` at `mlp.gate` (sigmoid scores, the
  `e_score_correction_bias` only selecting, `n_group` groups of which `topk_group` are kept,
  renormalised with `norm_topk_prob`, times `routed_scaling_factor`; fp32), experts at
  `mlp.experts` in HF's `[E, 2I, H]` layout through `SiluGLU` (I = `moe_intermediate_size`),
  plus `mlp.shared_experts`, a SwiGLU of `moe_intermediate_size * n_shared_experts`.

Checkpoints: one tensor per expert, `mlp.experts.{e}.{gate,up,down}_proj.weight`, as HF saves
them (`Experts.per_expert_sources`); the stacked layout loads by name. The MTP layers a
checkpoint carries past the last layer (`model.layers.{L+k}`, `num_nextn_predict_layers`)
belong to a drafter and are skipped here. Not served (one-line `ConfigError`s): the released
FP8 block-quantized files (`quantization_config`; dequantize to bf16 first), `num_key_value_heads
!= num_attention_heads` (HF's MLA does not run it either), no shared expert, `topk_method` other
than `noaux_tc`, `scoring_func` other than `sigmoid`.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from draftinfer.files.errors import ConfigError
from draftinfer.models.decoder import DecoderLayer, NativeCausalLM, NativeConfig, TensorSource
from draftinfer.models.grouped_moe import (
    GroupedMoEFields,
    grouped_moe_fields,
    grouped_moe_mlp,
    refuse_quantized,
    stacked_expert_sources,
)
from draftinfer.models.mla import LatentAttention, mla_softmax_scale

FAMILY = "deepseek_v3"


@dataclass
class DeepseekV3NativeConfig(NativeConfig, GroupedMoEFields):
    """`NativeConfig` (`head_dim` = `qk_rope_head_dim`, the rotary's width; `intermediate_size`
    the dense layers') plus MLA's ranks and head widths and the routed experts
    (`draftinfer.models.grouped_moe`)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    softmax_scale: float = 1.0


class DeepseekV3ForCausalLM(NativeCausalLM):
    """DeepSeek-V3 (and R1: the same architecture)."""

    hf_model_types = ("deepseek_v3",)
    family = FAMILY

    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> DeepseekV3NativeConfig:
        name = cls.__name__
        refuse_quantized(hf, name)
        for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            got = getattr(hf, key, want)
            if got != want:
                raise ConfigError(f"{name}: {key} {got!r} is not supported (only {want!r})")
        heads = int(hf.num_attention_heads)
        kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
        if kv_heads != heads:
            raise ConfigError(
                f"{name}: num_key_value_heads {kv_heads} != num_attention_heads {heads} "
                "(MLA expands the latent to every head)"
            )
        moe = grouped_moe_fields(hf, name)
        fields = cls.decoder_fields(hf, eos_token_ids)
        # The rotary covers the decoupled RoPE slice only (HF sets `head_dim` to it); every
        # head attends the latent (`num_kv_heads`: one mask row per query head).
        rope_dim = int(hf.qk_rope_head_dim)
        fields["head_dim"], fields["num_kv_heads"] = rope_dim, heads
        nope = int(hf.qk_nope_head_dim)
        q_rank = getattr(hf, "q_lora_rank", None)
        return DeepseekV3NativeConfig(
            **fields,
            q_lora_rank=None if q_rank is None else int(q_rank),
            kv_lora_rank=int(hf.kv_lora_rank),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(hf.v_head_dim),
            rope_interleave=bool(getattr(hf, "rope_interleave", True)),
            softmax_scale=mla_softmax_scale(nope + rope_dim, fields["rope_scaling"]),
            **moe,
        )

    @classmethod
    def block_flags(cls, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool, bool]:
        # `attention_bias` biases q_a / kv_a / o (read by `decoder_layer` from qkv_bias).
        return attention_bias, attention_bias, False, False

    @classmethod
    def attention(cls, cfg: DeepseekV3NativeConfig) -> LatentAttention:
        return LatentAttention(
            cfg.hidden_size,
            cfg.num_heads,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            softmax_scale=cfg.softmax_scale,
            rope_interleave=cfg.rope_interleave,
            bias=cfg.qkv_bias,  # the latent norms keep HF's eps (`mla.LATENT_NORM_EPS`)
        )

    @classmethod
    def decoder_layer(cls, cfg: DeepseekV3NativeConfig, index: int) -> nn.Module:
        mlp = grouped_moe_mlp(cfg, index)  # dense first layers, then routed + shared experts
        return DecoderLayer(cfg, cls.attention(cfg), mlp, norm=partial(cls.rms_norm, cfg))

    def checkpoint_sources(
        self, param: str, available: Container[str]
    ) -> list[TensorSource] | None:
        """The stacked expert parameters from the per-expert tensors HF saves
        (`Experts.per_expert_sources`)."""
        return stacked_expert_sources(self, param)
