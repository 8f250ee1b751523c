"""An independent reader of DeepSeek-layout MTP checkpoints, written from vLLM's loaders
(`vllm/model_executor/models/deepseek_mtp.py`, `DeepSeekMTP.load_weights`, with
`deepseek_v2.get_spec_layer_idx_from_weight_name`; `glm4_moe_mtp.py`, `Glm4MoeMTP.load_weights`;
`FusedMoE.make_expert_params_mapping`; REFERENCES part D, C4 and D), not from our
`layouts.py`: it builds the parameters vLLM's MTP model has for a config (names and shapes),
feeds it a checkpoint's tensors by vLLM's rules, and fails where vLLM would.

vLLM's rules, as read from those files:

- a checkpoint name is an MTP tensor when it starts with `model.layers.{L+i}.` for `i <
  num_nextn_predict_layers` (L = `num_hidden_layers`); every other name is skipped without a
  word (`ignored` lists them), as are names holding `rotary_emb.inv_freq`;
- names holding `embed_tokens`, `enorm`, `hnorm`, `eh_proj` or `shared_head` stay per layer,
  but `embed_tokens` is lifted to the shared `model.embed_tokens` (and read only from the first
  MTP layer); every other name gets `mtp_block.` after the layer prefix;
- stacked parameters load by shard: `gate_proj` / `up_proj` into `gate_up_proj` (shards 0, 1;
  the dense MLP and the shared experts), DeepSeek's `q_a_proj` / `kv_a_proj_with_mqa` into
  `fused_qkv_a_proj` (where `q_lora_rank` is set), GLM's `q_proj` / `k_proj` / `v_proj` into
  `qkv_proj` (weight and bias); a routed expert's name is skipped here;
- routed experts load per expert: `experts.{e}.gate_proj.` -> `experts.w13_` (shard w1, rows
  `[:I]` of expert e), `experts.{e}.up_proj.` -> `experts.w13_` (w3, rows `[I:]`),
  `experts.{e}.down_proj.` -> `experts.w2_` (w2); `w13_weight [E, 2I, H]`, `w2_weight [E, H, I]`;
- anything else loads by name with its exact shape (`default_weight_loader`); a name vLLM's
  model does not have is a `KeyError` (`params_dict[name]`), a `.bias` it lacks is skipped;
- a parameter no checkpoint tensor wrote fails the load ("Following weights were not
  initialized from checkpoint").

Stricter than vLLM where vLLM would load garbage silently: every element of every parameter
must be written exactly once, and every shard must have its exact shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SPEC_LAYER_WEIGHTS = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")


class VllmLoadError(Exception):
    """Where vLLM's MTP loader would fail (or, stricter, load a parameter partly)."""


@dataclass
class _Param:
    shape: tuple[int, ...]
    # shard id -> (dim-0 offset, rows) for stacked linears; None: loaded whole
    shards: dict | None = None
    experts: bool = False  # a FusedMoE parameter, loaded per (expert, shard)
    value: torch.Tensor | None = None
    written: torch.Tensor | None = None

    def __post_init__(self):
        self.value = torch.zeros(self.shape, dtype=torch.float32)
        self.written = torch.zeros(self.shape, dtype=torch.int32)


@dataclass
class VllmMTPLoad:
    """vLLM's MTP parameters as loaded: `params` (vLLM name -> tensor) and the checkpoint
    names its loader skipped (`ignored`)."""

    params: dict[str, torch.Tensor]
    ignored: list[str] = field(default_factory=list)


def _get(cfg: dict, key: str, default=None):
    v = cfg.get(key, default)
    return default if v is None else v


def _moe_layer(cfg: dict, idx: int) -> bool:
    """vLLM's `DeepseekV2DecoderLayer` / `Glm4MoeDecoderLayer`: routed where
    `n_routed_experts` is set and `idx >= first_k_dense_replace` (every `moe_layer_freq`);
    GLM-4.7-Flash's config lists the dense layers in `mlp_layer_types` instead."""
    if not cfg.get("n_routed_experts"):
        return False
    if "first_k_dense_replace" in cfg:
        first = int(cfg["first_k_dense_replace"])
    else:
        types = cfg.get("mlp_layer_types") or []
        first = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    return idx >= first and idx % int(_get(cfg, "moe_layer_freq", 1)) == 0


def _mla_attention(cfg: dict, p: str) -> dict[str, _Param]:
    H, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    v, kv_rank = int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"])
    q_rank = cfg.get("q_lora_rank")
    out = {}
    if q_rank:
        q_rank = int(q_rank)
        out[p + "fused_qkv_a_proj.weight"] = _Param(
            (q_rank + kv_rank + rope, H), shards={0: (0, q_rank), 1: (q_rank, kv_rank + rope)}
        )
        out[p + "q_a_layernorm.weight"] = _Param((q_rank,))
        out[p + "q_b_proj.weight"] = _Param((heads * (nope + rope), q_rank))
    else:
        out[p + "q_proj.weight"] = _Param((heads * (nope + rope), H))
        out[p + "kv_a_proj_with_mqa.weight"] = _Param((kv_rank + rope, H))
    out[p + "kv_a_layernorm.weight"] = _Param((kv_rank,))
    out[p + "kv_b_proj.weight"] = _Param((heads * (nope + v), kv_rank))
    out[p + "o_proj.weight"] = _Param((H, heads * v))
    return out


def _gqa_attention(cfg: dict, p: str) -> dict[str, _Param]:
    H, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv = int(_get(cfg, "num_key_value_heads", heads))
    hd = int(_get(cfg, "head_dim", H // heads))
    q, k = heads * hd, kv * hd
    shards = {"q": (0, q), "k": (q, k), "v": (q + k, k)}
    out = {p + "qkv_proj.weight": _Param((q + 2 * k, H), shards=shards)}
    if cfg.get("attention_bias"):
        out[p + "qkv_proj.bias"] = _Param((q + 2 * k,), shards=shards)
    out[p + "o_proj.weight"] = _Param((H, q))
    if cfg.get("use_qk_norm"):
        out[p + "q_norm.weight"] = _Param((hd,))
        out[p + "k_norm.weight"] = _Param((hd,))
    return out


def _mlp(cfg: dict, idx: int, p: str) -> dict[str, _Param]:
    H = int(cfg["hidden_size"])
    if not _moe_layer(cfg, idx):
        inter = int(cfg["intermediate_size"])
        return {
            p + "gate_up_proj.weight": _Param(
                (2 * inter, H), shards={0: (0, inter), 1: (inter, inter)}
            ),
            p + "down_proj.weight": _Param((H, inter)),
        }
    E, inter = int(cfg["n_routed_experts"]), int(cfg["moe_intermediate_size"])
    shared = inter * int(_get(cfg, "n_shared_experts", 1))
    out = {
        p + "gate.weight": _Param((E, H)),
        p + "experts.w13_weight": _Param((E, 2 * inter, H), experts=True),
        p + "experts.w2_weight": _Param((E, H, inter), experts=True),
        p + "shared_experts.gate_up_proj.weight": _Param(
            (2 * shared, H), shards={0: (0, shared), 1: (shared, shared)}
        ),
        p + "shared_experts.down_proj.weight": _Param((H, shared)),
    }
    if _get(cfg, "topk_method", "noaux_tc") == "noaux_tc":
        out[p + "gate.e_score_correction_bias"] = _Param((E,))
    return out


def mtp_parameters(cfg: dict, attention: str) -> dict[str, _Param]:
    """The parameters of vLLM's MTP model for target config `cfg` (a config.json dict):
    `attention` "mla" (`DeepSeekMTP`: DeepSeek-V3, GLM-4.7-Flash) or "gqa" (`Glm4MoeMTP`)."""
    H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    L, N = int(cfg["num_hidden_layers"]), int(cfg["num_nextn_predict_layers"])
    params = {"model.embed_tokens.weight": _Param((V, H))}
    for idx in range(L, L + N):
        p = f"model.layers.{idx}."
        params.update(
            {
                p + "enorm.weight": _Param((H,)),
                p + "hnorm.weight": _Param((H,)),
                p + "eh_proj.weight": _Param((H, 2 * H)),
                p + "shared_head.norm.weight": _Param((H,)),
                p + "shared_head.head.weight": _Param((V, H)),
            }
        )
        b = p + "mtp_block."
        params[b + "input_layernorm.weight"] = _Param((H,))
        params[b + "post_attention_layernorm.weight"] = _Param((H,))
        attn = _mla_attention if attention == "mla" else _gqa_attention
        params.update(attn(cfg, b + "self_attn."))
        params.update(_mlp(cfg, idx, b + "mlp."))
    return params


def _spec_layer(cfg: dict, name: str) -> int | None:
    L, N = int(cfg["num_hidden_layers"]), int(cfg.get("num_nextn_predict_layers") or 0)
    for idx in range(L, L + N):
        if name.startswith(f"model.layers.{idx}."):
            return idx
    return None


def _rewrite(spec_layer: int, name: str) -> str:
    hit = next((w for w in SPEC_LAYER_WEIGHTS if w in name), None)
    if hit is None:
        return name.replace(f"model.layers.{spec_layer}.", f"model.layers.{spec_layer}.mtp_block.")
    if hit == "embed_tokens":
        return name.replace(f"model.layers.{spec_layer}.", "model.")
    return name


def _write(param: _Param, name: str, where: tuple, t: torch.Tensor) -> None:
    region = param.value[where]
    if tuple(region.shape) != tuple(t.shape):
        raise VllmLoadError(
            f"{name}{list(where)}: shape {tuple(region.shape)}, got {tuple(t.shape)}"
        )
    region.copy_(t.float())
    param.written[where] += 1


def load_mtp(cfg: dict, tensors: dict[str, torch.Tensor], attention: str) -> VllmMTPLoad:
    """`tensors` (checkpoint name -> tensor) loaded into vLLM's MTP parameters for `cfg`
    (module docstring): the loaded parameters and the names skipped; `VllmLoadError` where
    vLLM fails or a parameter is not written exactly once in full."""
    params = mtp_parameters(cfg, attention)
    stacked = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    if attention == "mla":
        stacked += [
            ("fused_qkv_a_proj", "q_a_proj", 0),
            ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
        ]
    else:
        stacked += [
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
        ]
    E = int(cfg.get("n_routed_experts") or 0)
    experts = [
        (
            "experts.w13_" if w in ("gate_proj", "up_proj") else "experts.w2_",
            f"experts.{e}.{w}.",
            e,
            s,
        )
        for e in range(E)
        for s, w in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
    ]
    start = int(cfg["num_hidden_layers"])
    ignored = []

    def param(name: str) -> _Param:
        if name not in params:
            raise VllmLoadError(f"vLLM's MTP model has no parameter {name!r}")
        return params[name]

    for ckpt_name, t in tensors.items():
        if "rotary_emb.inv_freq" in ckpt_name:
            ignored.append(ckpt_name)
            continue
        spec = _spec_layer(cfg, ckpt_name)
        if spec is None:
            ignored.append(ckpt_name)
            continue
        name = _rewrite(spec, ckpt_name)
        for param_name, weight_name, shard in stacked:
            if weight_name not in name:
                continue
            if "mlp.experts." in name and name not in params:
                continue  # a routed expert: below
            mapped = name.replace(weight_name, param_name)
            if param_name == "fused_qkv_a_proj" and mapped not in params:
                continue  # no q LoRA: loaded by name below
            name = mapped
            if name.endswith(".bias") and name not in params:
                ignored.append(ckpt_name)
                break
            p = param(name)
            offset, rows = p.shards[shard]
            _write(p, name, (slice(offset, offset + rows),), t)
            break
        else:
            for param_name, weight_name, e, shard in experts:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                p = param(name)
                inter = p.shape[1] // 2 if param_name.endswith("w13_") else None
                where = {"w1": (e, slice(0, inter)), "w3": (e, slice(inter, None)), "w2": (e,)}
                _write(p, name, where[shard], t)
                break
            else:
                if name.endswith(".bias") and name not in params:
                    ignored.append(ckpt_name)
                    continue
                if spec != start and ".layers" not in name:
                    ignored.append(ckpt_name)  # the shared embedding: the first layer's only
                    continue
                _write(param(name), name, (), t)  # default_weight_loader: the exact shape

    for name, p in params.items():
        if not bool((p.written == 1).all()):
            n = int((p.written == 0).sum())
            raise VllmLoadError(
                f"{name}: {n} of {p.written.numel()} values not written"
                if n
                else f"{name}: values written twice"
            )
    return VllmMTPLoad({n: p.value for n, p in params.items()}, ignored)


__all__ = ["VllmLoadError", "VllmMTPLoad", "load_mtp", "mtp_parameters"]
