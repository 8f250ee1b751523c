"""Native gpt-oss target (transformers' `GptOssForCausalLM`): the shared decoder with this
family's layers.

    model = load_native_target("path/to/gpt-oss-20b", "cuda", torch.bfloat16, 8, 4096)

What differs from the dense Llama block (REFERENCES part D, A1-A4; HF `modeling_gpt_oss.py`):
- attention: biases on q/k/v/o (`attention_bias`), a learned sink logit per query head
  (`self_attn.sinks [nh]`, a softmax column with no value), and a sliding window of
  `sliding_window` keys on the layers `layer_types` marks `sliding_attention` (the even ones
  in the released models; a query at p reads keys p - window < j <= p);
- RoPE: YaRN with `truncate: false`, the attention factor on cos and sin, NeoX halves;
- norms: `RMSNorm(scale_in_fp32=True)` (HF `GptOssRMSNorm`: the fp32 weight multiplies before
  the cast back);
- MLP: every layer is routed (`draftinfer.models.moe`): `TopKSoftmaxRouter` at `mlp.router`
  (a `Linear` with bias, top-k logits, softmax over the k), experts at `mlp.experts` in HF's
  `x @ W` layout (`gate_up_proj [E, H, 2I]` interleaved gate/up, `down_proj [E, I, H]`, both
  with biases) through `ClampedSwiGLU(swiglu_alpha, swiglu_limit)`.

Checkpoints: the bf16 layout loads by name; the released MXFP4 layout
(`mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}`, biases by name) is dequantized exactly to
the model's dtype at load (`checkpoint_sources`, `mxfp4.dequantize_mxfp4`).

Feature taps are read from the residual stream as for every family (the input of layer j =
HF `output_hidden_states[j]`; DESIGN convention 2). The caches of window layers stay full
length (`draftinfer.models.kv_cache`).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torch import nn

from draftinfer.families.gpt_oss.mxfp4 import dequantize_mxfp4
from draftinfer.files.errors import ConfigError
from draftinfer.models.decoder import (
    AttentionOptions,
    CachedAttention,
    DecoderLayer,
    NativeCausalLM,
    NativeConfig,
    TensorSource,
)
from draftinfer.models.layers import RMSNorm
from draftinfer.models.moe import ClampedSwiGLU, Experts, MoEBlock, TopKSoftmaxRouter

FAMILY = "gpt_oss"
LAYER_KINDS = ("sliding_attention", "full_attention")
# Expert matrices the released checkpoints store as MXFP4 blocks and scales.
MXFP4_PARAMS = ("gate_up_proj", "down_proj")


@dataclass
class GptOssNativeConfig(NativeConfig):
    """`NativeConfig` plus gpt-oss's routed experts and per-layer windows
    (`intermediate_size` is the expert's I)."""

    num_experts: int = 0
    top_k: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_windows: tuple[int | None, ...] = field(default_factory=tuple)  # None: full causal


class GptOssForCausalLM(NativeCausalLM):
    """gpt-oss (20b / 120b and smaller configs of the same architecture)."""

    hf_model_types = ("gpt_oss",)
    family = FAMILY

    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> GptOssNativeConfig:
        name = cls.__name__
        L = int(hf.num_hidden_layers)
        kinds = list(getattr(hf, "layer_types", None) or [])
        if len(kinds) != L:
            raise ConfigError(f"{name}: layer_types has {len(kinds)} entries for {L} layers")
        unknown = sorted({k for k in kinds if k not in LAYER_KINDS})
        if unknown:
            raise ConfigError(
                f"{name}: layer type {unknown[0]!r} is not supported (known: {LAYER_KINDS})"
            )
        window = getattr(hf, "sliding_window", None)
        if "sliding_attention" in kinds and not (isinstance(window, int) and window >= 1):
            raise ConfigError(f"{name}: sliding layers need sliding_window >= 1, got {window!r}")
        quant = getattr(hf, "quantization_config", None) or {}
        if not isinstance(quant, dict):
            quant = quant.to_dict()
        method = quant.get("quant_method")
        if method not in (None, "mxfp4"):
            raise ConfigError(f"{name}: quantization {method!r} is not supported (only mxfp4)")
        experts, top_k = int(hf.num_local_experts), int(hf.num_experts_per_tok)
        if not 1 <= top_k <= experts:
            raise ConfigError(f"{name}: num_experts_per_tok {top_k} for {experts} experts")
        fields = cls.decoder_fields(hf, eos_token_ids)
        return GptOssNativeConfig(
            **fields,
            num_experts=experts,
            top_k=top_k,
            swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)),
            layer_windows=tuple(window if k == "sliding_attention" else None for k in kinds),
        )

    @classmethod
    def block_flags(cls, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool, bool]:
        return attention_bias, attention_bias, False, False  # bias on q/k/v/o; no q/k norm

    @classmethod
    def rms_norm(cls, cfg: NativeConfig, dim: int) -> nn.Module:
        return RMSNorm(dim, cfg.rms_norm_eps, scale_in_fp32=True)

    @classmethod
    def decoder_layer(cls, cfg: GptOssNativeConfig, index: int) -> nn.Module:
        window = cfg.layer_windows[index]
        attn = CachedAttention(cfg, AttentionOptions.of(cfg, window=window, sinks=True))
        H = cfg.hidden_size
        router = TopKSoftmaxRouter(H, cfg.num_experts, cfg.top_k, bias=True)
        act = ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
        experts = Experts(cfg.num_experts, H, cfg.intermediate_size, act, bias=True, x_at_w=True)
        mlp = MoEBlock(router, experts, router_name="router")
        return DecoderLayer(cfg, attn, mlp, norm=partial(cls.rms_norm, cfg))

    def checkpoint_sources(
        self, param: str, available: Container[str]
    ) -> list[TensorSource] | None:
        """An expert matrix the checkpoint stores in MXFP4 (`{param}_blocks`,
        `{param}_scales`): dequantized to the model's dtype (`mxfp4.dequantize_mxfp4`)."""
        prefix, _, leaf = param.rpartition(".")
        if not prefix.endswith("mlp.experts") or leaf not in MXFP4_PARAMS:
            return None
        if f"{param}_blocks" not in available and f"{param}_scales" not in available:
            return None
        dtype = self.get_parameter(param).dtype
        convert = partial(dequantize_mxfp4, dtype=dtype)
        return [TensorSource((f"{param}_blocks", f"{param}_scales"), convert=convert)]
