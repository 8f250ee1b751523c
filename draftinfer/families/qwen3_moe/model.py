"""Native Qwen3-MoE target (transformers' `Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): the shared
decoder with this family's layers.

    model = load_native_target("path/to/qwen3-30b-a3b", "cuda", torch.bfloat16, 8, 4096)

What differs from the dense Qwen3 block (REFERENCES part D, E; HF `modeling_qwen3_moe.py`):
- MLP: routed (`draftinfer.models.moe`) on every layer but `mlp_only_layers`:
  `SoftmaxTopKRouter` at `mlp.gate` (softmax over all experts in fp32, top-k, renormalised
  when `norm_topk_prob`; no bias), experts at `mlp.experts` in HF's in-memory layout
  (`gate_up_proj [E, 2I, H]`: gate rows then up rows; `down_proj [E, H, I]`; no biases) through
  `SiluGLU`, I = `moe_intermediate_size`; the `mlp_only_layers` are dense SwiGLU MLPs of
  `intermediate_size` (`mlp.{gate,up,down}_proj`);
- attention: Qwen3's (q/k RMSNorm before RoPE, `attention_bias` on all four projections).

Checkpoints: the released files store one tensor per expert,
`mlp.experts.{e}.{gate,up,down}_proj.weight` (`(out, in)`); `checkpoint_sources` copies them
into slices of the stacked parameters (a checkpoint in the stacked in-memory layout loads by
name). Not served (one-line `ConfigError`s): `decoder_sparse_step != 1`, a shared expert,
sliding windows, no experts at all.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from draftinfer.files.errors import ConfigError
from draftinfer.models.decoder import (
    DecoderLayer,
    NativeCausalLM,
    NativeConfig,
    TensorSource,
)
from draftinfer.models.moe import Experts, MoEBlock, SiluGLU, SoftmaxTopKRouter

FAMILY = "qwen3_moe"
# Config fields of MoE relatives (Qwen2-MoE, Qwen3-Next) this family does not serve.
_SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts")


@dataclass
class Qwen3MoeNativeConfig(NativeConfig):
    """`NativeConfig` plus Qwen3-MoE's routed experts (`intermediate_size` is the dense
    layers')."""

    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)


class Qwen3MoeForCausalLM(NativeCausalLM):
    """Qwen3-MoE (30B-A3B, 235B-A22B and smaller configs of the same architecture)."""

    hf_model_types = ("qwen3_moe",)
    family = FAMILY

    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> Qwen3MoeNativeConfig:
        name = cls.__name__
        L = int(hf.num_hidden_layers)
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        if step != 1:
            raise ConfigError(
                f"{name}: decoder_sparse_step {step} is not supported (only 1; use "
                "mlp_only_layers for dense layers)"
            )
        for key in _SHARED_EXPERT_FIELDS:
            if getattr(hf, key, None):
                raise ConfigError(f"{name}: a shared expert ({key}) is not supported")
        experts, top_k = int(hf.num_experts or 0), int(hf.num_experts_per_tok)
        if experts < 1:
            raise ConfigError(f"{name}: num_experts {experts}: a dense model, not an MoE")
        if not 1 <= top_k <= experts:
            raise ConfigError(f"{name}: num_experts_per_tok {top_k} for {experts} experts")
        dense = tuple(sorted({int(i) for i in (getattr(hf, "mlp_only_layers", None) or [])}))
        if any(not 0 <= i < L for i in dense):
            raise ConfigError(f"{name}: mlp_only_layers {list(dense)} out of range 0..{L - 1}")
        # NativeCausalLM's rule refuses sliding windows (`use_sliding_window`).
        base = super().config_from_hf(hf, eos_token_ids)
        fields = {f: getattr(base, f) for f in NativeConfig.__dataclass_fields__}
        return Qwen3MoeNativeConfig(
            **fields,
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=int(hf.moe_intermediate_size),
            norm_topk_prob=bool(hf.norm_topk_prob),
            mlp_only_layers=dense,
        )

    @classmethod
    def block_flags(cls, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool, bool]:
        return attention_bias, attention_bias, False, True  # Qwen3 attention: q/k norm

    @classmethod
    def decoder_layer(cls, cfg: Qwen3MoeNativeConfig, index: int) -> nn.Module:
        if index in cfg.mlp_only_layers:
            return super().decoder_layer(cfg, index)  # dense SwiGLU of intermediate_size
        H, E = cfg.hidden_size, cfg.num_experts
        router = SoftmaxTopKRouter(H, E, cfg.top_k, cfg.norm_topk_prob)
        experts = Experts(E, H, cfg.moe_intermediate_size, SiluGLU(), bias=False, x_at_w=False)
        return DecoderLayer(cfg, mlp=MoEBlock(router, experts, router_name="gate"))

    def checkpoint_sources(
        self, param: str, available: Container[str]
    ) -> list[TensorSource] | None:
        """The stacked expert parameters from the released per-expert tensors
        (`Experts.per_expert_sources`)."""
        prefix, _, leaf = param.rpartition(".")
        if not prefix.endswith("mlp.experts"):
            return None
        return self.get_submodule(prefix).per_expert_sources(prefix, leaf)
