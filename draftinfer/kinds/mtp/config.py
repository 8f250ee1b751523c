"""Multi-layer MTP drafter architecture (`mtp`): N distinct modules, module k drafts token k.

What `config.json` holds (DESIGN section 4, mtp): the *target family's own config* (what
engines read for `speculative_config.model`) with `num_nextn_predict_layers = N`, plus our
fields under `"drafttrain"`:

- `n_predict`: N, the number of modules (must equal `num_nextn_predict_layers` and the modules
  present in the weights, S8);
- `mtp_feature_tap`: which target final hidden state feeds module 0 (`pre_norm` | `post_norm`;
  DeepSeek and Qwen3.5 serve the post-final-norm one);
- `mtp_chain`: module k+1 consumes module k's output (DeepSeek paper, Step-3.5) or every
  module consumes the target feature (MiMo);
- `mtp_carry`: which output of module k is carried when chained (`pre_norm`: vLLM's DeepSeek
  MTP and SGLang's Step-3.5 carry the pre-`shared_head.norm` state; `post_norm`:
  transformers' `MtpModel`);
- `mask_pos0_embedding`: zero the token embedding at RoPE position 0, as vLLM's
  `DeepSeekMultiTokenPredictorLayer` does (`inputs_embeds[positions == 0] = 0`);
- `block`: `native` (run by training and the runner alike: a Llama/Qwen2/Qwen3 decoder layer,
  `draftinfer.models.layers.DecoderLayer`, or, for a family whose layers are not that dense
  block (DeepSeek-V3), the family's own native layer at index `L + k` with its own cache,
  `own_layer`, `native_layer`) or `hf` (the target family's own decoder-layer class,
  for training against any HF causal LM; the runner refuses it);
- `layout`: the checkpoint layout and the semantics that go with it (`layouts.py`):
  `deepseek` (`model.layers.{L+k}.*`, embedding-first concat, a final norm per module, module
  k's RoPE position advanced by k as Megatron and transformers' `MtpModel` train it) or `mrv2`
  (vLLM Model Runner V2's multi-module contract with the Inkling layout: `model.mtp.layers.{k}.*`,
  hidden-first concat, one `chain_norm` shared by all modules, module k at the window
  position p itself; REFERENCES "Multi-module MTP in vLLM MRv2").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from draftinfer.conventions.positions import draft_step_positions
from draftinfer.files.checkfields import require
from draftinfer.files.errors import CheckpointError, ConfigError
from draftinfer.models.rope import rope_axes, rope_from_hf
from draftinfer.models.target import FINAL_HIDDEN, FeatureSpec

# Fields of a target config.json that are not the architecture (dropped when re-read).
_NOT_ARCH = (
    "drafttrain",
    "num_nextn_predict_layers",
    "mtp_config",
    "torch_dtype",
    "dtype",
    "_name_or_path",
)
# Not written to the served config: `_name_or_path` (transformers' bookkeeping: the directory
# the target was loaded from, a path of the training machine) and `dtype` (the target's load
# dtype; the export records its own as `torch_dtype`, which transformers 5 reads as `dtype`).
_NOT_SERVED = ("_name_or_path", "dtype")
OURS = (
    "n_predict",
    "mtp_feature_tap",
    "mtp_chain",
    "mtp_carry",
    "mask_pos0_embedding",
    "block",
    "layout",
)
LAYOUTS = ("deepseek", "mrv2")


def module_positions(layout: str, rope_pos: torch.Tensor, k: int) -> torch.Tensor:
    """RoPE positions of module k's rows `[..., T]` from the rows' own positions (one
    definition for training and the runner). Row i of module k consumes `t_{i+k+1}`;
    `deepseek` places it at `pos_i + k` (Megatron, transformers' `MtpModel`: position advances
    with depth); `mrv2` at `pos_i` (vLLM MRv2 runs module k "on all window positions p, at RoPE
    position p")."""
    if layout == "mrv2":
        return rope_pos.clone()  # a new tensor: callers never share the target's buffer
    return draft_step_positions(rope_pos, k)


@dataclass
class MTPConfig:
    kind: ClassVar[str] = "mtp"

    n_predict: int
    target_config: dict[str, Any] = field(default_factory=dict)  # the target's config.json
    mtp_feature_tap: str = "post_norm"
    mtp_chain: bool = True
    mtp_carry: str = "pre_norm"
    mask_pos0_embedding: bool = True
    block: str = "native"
    layout: str = "deepseek"

    def __post_init__(self) -> None:
        if self.n_predict < 1:
            raise ConfigError(f"n_predict must be >= 1, got {self.n_predict}")
        for name in ("mtp_feature_tap", "mtp_carry"):
            if getattr(self, name) not in FINAL_HIDDEN:
                raise ConfigError(
                    f"{name} must be one of {FINAL_HIDDEN}, got {getattr(self, name)!r}"
                )
        if self.block not in ("native", "hf"):
            raise ConfigError(f"block must be native or hf, got {self.block!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "mrv2" and self.mask_pos0_embedding:
            # Only DeepSeek's MTP layer zeroes it (REFERENCES C); an mrv2 engine would not.
            raise ConfigError(
                "the mrv2 layout has no zeroed position-0 embedding: set mask_pos0_embedding false"
            )
        c = self.target_config
        for key in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size"):
            if key not in c:
                raise ConfigError(f"mtp target_config has no {key!r}")
        self.hidden_size = int(c["hidden_size"])
        self.vocab_size = int(c["vocab_size"])
        self.target_num_layers = int(c["num_hidden_layers"])
        self.max_position_embeddings = int(c.get("max_position_embeddings", 0))
        self.architecture = c["architectures"][0]
        self.own_layer = False
        if self.block == "native":
            self._native_block()

    def _native_block(self) -> None:
        """Block and RoPE fields from the target family's config (the native targets' rules)."""
        from draftinfer.files.loading import native_class_for
        from draftinfer.registry import FAMILIES

        c = self.target_config
        cls = native_class_for(c)  # a one-line ConfigError for a family we cannot run
        # The family's own native layer as each module's block, where its layers are not the
        # dense Llama block (`drafter_block` without `dense_decoder_layer`; `native_layer`).
        provides = FAMILIES.for_architectures(c["architectures"]).provides
        self.own_layer = "dense_decoder_layer" not in provides
        if self.own_layer:
            native = self.native_layer()[1]
            self.rms_norm_eps = native.rms_norm_eps
            # The rotary's width: MLA's RoPE slice (its `head_dim`), GLM-4.5's rotated part of
            # each head (`rotary_dim`, partial rotary), else the head.
            self.head_dim = native.rotary_dim or native.head_dim
            self.rope_theta, self.rope_scaling = native.rope_theta, native.rope_scaling
            return
        self.num_attention_heads = int(c["num_attention_heads"])
        self.num_key_value_heads = int(c.get("num_key_value_heads") or self.num_attention_heads)
        self.head_dim = int(c.get("head_dim") or self.hidden_size // self.num_attention_heads)
        self.intermediate_size = int(c["intermediate_size"])
        self.rms_norm_eps = float(c.get("rms_norm_eps", 1e-6))
        bias = bool(c.get("attention_bias", False))
        family = cls.block_flags(bias, bool(c.get("mlp_bias", False)))
        self.qkv_bias, self.o_bias, self.mlp_bias, self.qk_norm = family
        self.rope_theta, self.rope_scaling = rope_from_hf(_Attrs(c), self.head_dim)

    def native_layer(self):
        """(the target family's native class, its `NativeConfig`) for `own_layer` blocks: module
        k's block is `cls.decoder_layer(cfg, L + k)`, the layer the target would have at that
        index (DeepSeek-V3: MLA with a latent cache, routed experts past
        `first_k_dense_replace`), built from the target's config.json as the runner builds the
        target."""
        if getattr(self, "_native", None) is None:
            import transformers

            from draftinfer.files.loading import native_class_for

            cls = native_class_for(self.target_config)
            try:
                hf = transformers.AutoConfig.for_model(**self.target_config)
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"mtp target_config: {e}") from None
            self._native = (cls, cls.config_from_hf(hf, []))
        return self._native

    # -- what every drafter config provides -----------------------------------------------
    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def features(self) -> FeatureSpec:
        return FeatureSpec(final_hidden=self.mtp_feature_tap)

    @property
    def rope_axes(self) -> int:
        return rope_axes(getattr(self, "rope_scaling", None))

    @property
    def hidden_first(self) -> bool:
        """Concat order of the module input: `[h, emb]` (Inkling / mrv2) or `[emb, h]`."""
        return self.layout == "mrv2"

    @property
    def shared_norm(self) -> bool:
        """One final norm for every module (Inkling's `chain_norm`) or one per module."""
        return self.layout == "mrv2"

    def module_positions(self, rope_pos: torch.Tensor, k: int) -> torch.Tensor:
        return module_positions(self.layout, rope_pos, k)

    def ours(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in OURS}

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items()}

    def to_hf(self) -> dict[str, Any]:
        """The target family's config with the module count engines read. RoPE is written in
        both spellings: transformers 5's `to_dict` keeps only `rope_parameters`, while engines
        on transformers 4 (and code reading the dict) read `rope_theta` / `rope_scaling`; a
        missing `rope_scaling` would silently drop e.g. Llama-3's scaling there. Likewise a
        partial rotary's `partial_rotary_factor` (GLM-4.5) at the top level, where 4.x configs
        and the released config.json keep it."""
        arch = {k: v for k, v in self.target_config.items() if k not in _NOT_SERVED}
        rope = arch.get("rope_parameters")
        if isinstance(rope, dict):
            if arch.get("rope_theta") is None and "rope_theta" in rope:
                arch["rope_theta"] = rope["rope_theta"]
            scaled = rope.get("rope_type", "default") != "default" or "mrope_section" in rope
            if arch.get("rope_scaling") is None and scaled:
                arch["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
            if arch.get("partial_rotary_factor") is None and "partial_rotary_factor" in rope:
                arch["partial_rotary_factor"] = rope["partial_rotary_factor"]
        out = {**arch, "num_nextn_predict_layers": self.n_predict}
        if self.layout == "mrv2":
            # Inkling's block (what vLLM's `inkling_mtp` reads `n_predict` and the chain norm
            # from); `mtp_hidden_states_first` says the concat order (REFERENCES 1.5).
            out["mtp_config"] = {
                "num_nextn_predict_layers": self.n_predict,
                "chain_hidden_post_norm": self.mtp_carry == "post_norm",
                "mtp_hidden_states_first": True,
                "local_layer_ids": [],
            }
        return out

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> MTPConfig:
        meta = d.get("drafttrain") or {}
        n = int(require(d, "num_nextn_predict_layers", where))
        # `layout` arrived with the mrv2 layout: checkpoints written before are `deepseek`.
        ours = {
            name: meta.get(name, "deepseek")
            if name == "layout"
            else require(meta, name, f"{where} [drafttrain]")
            for name in OURS
        }
        if ours["n_predict"] != n:
            raise CheckpointError(
                f"{where}: num_nextn_predict_layers {n} != drafttrain.n_predict {ours['n_predict']}"
            )
        target = {k: v for k, v in d.items() if k not in _NOT_ARCH}
        try:
            return cls(target_config=target, **ours)
        except ConfigError as e:
            raise CheckpointError(f"{where}: {e}") from None


class _Attrs:
    """A config dict seen as attributes (for `rope_from_hf`)."""

    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)
