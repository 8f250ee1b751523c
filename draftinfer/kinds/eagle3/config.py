"""EAGLE-3 drafter architecture: what a checkpoint's `config.json` describes.

Serving format: vLLM / SGLang `LlamaForCausalLMEagle3` (llama-style fields, `draft_vocab_size`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` at top level and in `eagle_config`,
`norm_before_residual`), plus vllm-project/speculators' `eagle3` format.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from draftinfer.files.checkfields import require, require_any
from draftinfer.files.errors import ConfigError
from draftinfer.models.rope import parse_rope
from draftinfer.models.target import FeatureSpec


@dataclass
class Eagle3Config:
    kind: ClassVar[str] = "eagle3"
    architecture: ClassVar[str] = "LlamaForCausalLMEagle3"
    speculators_type: ClassVar[str] = "eagle3"
    speculators_architecture: ClassVar[str] = "Eagle3Speculator"

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    # Target layers whose *inputs* are tapped (convention 2), concatenated in this order.
    aux_layer_ids: list[int] = field(default_factory=list)
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # the target's (incl. `mrope_section`)
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        # Strict rope: an unknown key would otherwise be dropped silently.
        self.rope_theta, self.rope_scaling = parse_rope(
            {"rope_theta": self.rope_theta, **(self.rope_scaling or {})},
            self.head_dim,
            f"{self.kind} drafter",
        )
        if len(self.aux_layer_ids) != 3:
            raise ConfigError(
                f"EAGLE-3 uses exactly 3 aux taps, got aux_layer_ids {list(self.aux_layer_ids)}"
            )

    @property
    def features(self) -> FeatureSpec:
        """What the drafter consumes from the target: the inputs of the 3 tapped layers."""
        return FeatureSpec(layer_inputs=tuple(self.aux_layer_ids))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf(self) -> dict[str, Any]:
        """The engine-facing config.json fields (our own fields go under `drafttrain`)."""
        aux = list(self.aux_layer_ids)
        d = {
            "architectures": [self.architecture],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": self.attention_bias,
            "norm_before_residual": self.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": aux,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        }
        if self.rope_scaling and "mrope_section" in self.rope_scaling:
            # A drafter of an M-RoPE target (Qwen3-VL). vLLM gives the drafter 3-D positions only
            # if *its* config declares M-RoPE (`uses_mrope` reads `rope_parameters`, which
            # vLLM builds from `rope_scaling` + `rope_theta` for older configs), and its M-RoPE
            # rotary is interleaved only with `mrope_interleaved: true` (the default is the
            # Qwen2-VL chunked layout); both keys are written (docs/training.md).
            d["rope_parameters"] = {"rope_theta": self.rope_theta, **self.rope_scaling}
        return d

    @classmethod
    def hf_fields(cls, d: dict[str, Any], where: str) -> dict[str, Any]:
        """Constructor arguments from config.json; every field our writer writes is required."""
        aux = require_any(
            {**d, **{f"eagle_config.{k}": v for k, v in (d.get("eagle_config") or {}).items()}},
            (
                "eagle_aux_hidden_state_layer_ids",
                "eagle_config.eagle_aux_hidden_state_layer_ids",
            ),
            where,
        )
        names = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
            "num_hidden_layers",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "max_position_embeddings",
            "norm_before_residual",
            "attention_bias",
        )
        return {"aux_layer_ids": list(aux), **{n: require(d, n, where) for n in names}}

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> Eagle3Config:
        try:
            return cls(**cls.hf_fields(d, where))
        except ConfigError as e:
            from draftinfer.files.errors import CheckpointError

            raise CheckpointError(f"{where}: {e}") from None
