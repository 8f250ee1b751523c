"""The routed MLP of DeepSeek-V3-style MoE targets, one definition for the families whose
configs spell it the same way (DeepSeek-V3, GLM-4.5/4.6 `glm4_moe`, GLM-4.7-Flash
`glm4_moe_lite`; DESIGN 14: one block and one router per routing rule):

    fields = grouped_moe_fields(hf, "Glm4MoeForCausalLM")   # validated, one-line ConfigErrors
    cfg = FamilyConfig(**decoder_fields, **fields)           # a NativeConfig + GroupedMoEFields
    mlp = grouped_moe_mlp(cfg, index)                        # layer `index`'s MLP

What the HF configs say (REFERENCES part D, C3 and D; HF `DeepseekV3TopkRouter`,
`Glm4MoeTopkRouter`, `DeepseekV3MoE`, `Glm4MoeMoE`, the same computation under two names):
- the first layers are dense SwiGLUs of `intermediate_size`: `first_k_dense_replace` of them,
  or, where the config lists `mlp_layer_types` (`glm4_moe_lite`), its leading `"dense"` entries
  (any other pattern is refused);
- the other layers route: `GroupedSigmoidRouter` at `mlp.gate` (sigmoid scores, the
  `e_score_correction_bias` only selecting, `n_group` groups of which `topk_group` are kept,
  `num_experts_per_tok` experts, renormalised with `norm_topk_prob`, times
  `routed_scaling_factor`; fp32), `n_routed_experts` experts at `mlp.experts` in HF's
  `[E, 2I, H]` layout through `SiluGLU` (I = `moe_intermediate_size`), plus
  `mlp.shared_experts`, a SwiGLU of `moe_intermediate_size * n_shared_experts` added to every
  token's routed sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from draftinfer.files.errors import ConfigError
from draftinfer.models.layers import SwiGLU
from draftinfer.models.moe import Experts, GroupedSigmoidRouter, MoEBlock, SiluGLU


@dataclass(kw_only=True)
class GroupedMoEFields:
    """The routed MLP's fields a family's `NativeConfig` subclass inherits (keyword-only, so
    they follow `NativeConfig`'s positional fields): `intermediate_size` stays the dense
    layers'."""

    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0


def refuse_quantized(hf: Any, name: str) -> None:
    """A one-line `ConfigError` for a quantized checkpoint (FP8 and the like): these families
    load bf16/fp32 weights only."""
    quant = getattr(hf, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
        raise ConfigError(
            f"{name}: quantization {method!r} is not supported (dequantize the checkpoint "
            "to bf16 first)"
        )


def dense_prefix(hf: Any, name: str) -> int:
    """How many leading layers are dense: `first_k_dense_replace`, or the leading `"dense"`
    entries of `mlp_layer_types` where the config lists the layers (then every later entry must
    be `"sparse"`)."""
    L = int(hf.num_hidden_layers)
    types = getattr(hf, "mlp_layer_types", None)
    if types is None:
        dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
        if not 0 <= dense <= L:
            raise ConfigError(f"{name}: first_k_dense_replace {dense} for {L} layers")
        return dense
    types = list(types)
    dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if len(types) != L or any(t != "sparse" for t in types[dense:]):
        raise ConfigError(
            f"{name}: mlp_layer_types {types} not supported (only {L} entries, 'dense' layers "
            "first, then 'sparse')"
        )
    return dense


def grouped_moe_fields(hf: Any, name: str) -> dict[str, Any]:
    """The `GroupedMoEFields` of an HF config; a one-line `ConfigError` naming `name` for what
    the block does not run (no routed or no shared experts, groups that do not split the
    experts, a top-k the kept groups cannot fill)."""
    experts, top_k = int(getattr(hf, "n_routed_experts", 0) or 0), int(hf.num_experts_per_tok)
    n_group, topk_group = int(hf.n_group or 1), int(hf.topk_group or 1)
    shared = int(getattr(hf, "n_shared_experts", 0) or 0)
    if experts < 1:
        raise ConfigError(f"{name}: n_routed_experts {experts}: a dense model, not an MoE")
    if experts % n_group or experts // n_group < 2:
        raise ConfigError(f"{name}: {experts} experts do not split into {n_group} groups of >= 2")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"{name}: topk_group {topk_group} of {n_group} groups")
    if not 1 <= top_k <= topk_group * (experts // n_group):
        raise ConfigError(
            f"{name}: num_experts_per_tok {top_k} for {topk_group} kept groups of "
            f"{experts // n_group} experts"
        )
    if shared < 1:
        raise ConfigError(f"{name}: n_shared_experts {shared}: only >= 1 shared experts")
    return dict(
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=int(hf.moe_intermediate_size),
        n_shared_experts=shared,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(hf.norm_topk_prob),
        routed_scaling_factor=float(hf.routed_scaling_factor),
        first_k_dense_replace=dense_prefix(hf, name),
    )


def grouped_moe_mlp(cfg: Any, index: int) -> nn.Module:
    """Layer `index`'s MLP for a config with `GroupedMoEFields` (and `hidden_size`,
    `intermediate_size`): a dense `SwiGLU` in the first `first_k_dense_replace` layers, else
    the routed block with its shared experts (module docstring)."""
    H = cfg.hidden_size
    if index < cfg.first_k_dense_replace:
        return SwiGLU(H, cfg.intermediate_size)
    E, inter = cfg.num_experts, cfg.moe_intermediate_size
    router = GroupedSigmoidRouter(
        H,
        E,
        cfg.top_k,
        cfg.n_group,
        cfg.topk_group,
        cfg.norm_topk_prob,
        cfg.routed_scaling_factor,
    )
    experts = Experts(E, H, inter, SiluGLU(), bias=False, x_at_w=False)
    shared = SwiGLU(H, inter * cfg.n_shared_experts)
    return MoEBlock(router, experts, "gate", shared_experts=shared)


def stacked_expert_sources(model: nn.Module, param: str) -> list | None:
    """`NativeCausalLM.checkpoint_sources` for these families: the stacked expert parameters
    from the per-expert tensors HF saves (`Experts.per_expert_sources`); None elsewhere."""
    prefix, _, leaf = param.rpartition(".")
    if not prefix.endswith("mlp.experts"):
        return None
    return model.get_submodule(prefix).per_expert_sources(prefix, leaf)
