"""EAGLE-3 drafter: one definition used by training (`drafttrain`) and the runner.

Vocabulary (used throughout the project):
- *draft step*: one drafter forward that proposes one token per row (chain drafting).
- *aux taps*: target hidden states entering target layers `aux_layer_ids` (DESIGN 3.2),
  concatenated to `[..., 3 * target_hidden]` and projected by `fc` to the drafter width.
- *carried feature*: what a row feeds as `hidden` into the next draft step: `fc(aux)` at
  step 0, the drafter's own *pre-norm* output afterwards (convention 5).
- *draft vocabulary*: the `draft_vocab_size` ids the `lm_head` scores; `d2t[i]` is the
  offset to the target id (`i + d2t[i]`), `t2d` a bool mask over the target vocabulary.

Architecture (vLLM / SGLang `LlamaForCausalLMEagle3` layout): layer 0 normalizes the token
embedding (`input_layernorm`) and the carried feature (`hidden_norm`) and attends over their
concatenation (qkv input width 2H); later layers (P-EAGLE style stacks) are plain Llama
layers. The residual stream starts from the carried feature (or its normed version with
`norm_before_residual`). `norm` gives the logits' input; the stream before it is the
carried feature for the next step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from draftinfer.drafters.layers import Attention, AttnFn, RMSNorm, RotaryEmbedding, SwiGLU


@dataclass
class Eagle3Config:
    """Architecture of an EAGLE-3 drafter (what a checkpoint's config.json describes)."""

    kind: ClassVar[str] = "eagle3"

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    attention_bias: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- serving format (vLLM / SGLang `LlamaForCausalLMEagle3` config.json) ---------------
    architecture: ClassVar[str] = "LlamaForCausalLMEagle3"

    def to_hf(self) -> dict[str, Any]:
        """The engine-facing config.json fields (our own fields go under `drafttrain`)."""
        aux = list(self.aux_layer_ids)
        return {
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

    speculators_type: ClassVar[str] = "eagle3"
    speculators_architecture: ClassVar[str] = "Eagle3Speculator"

    def speculators_config(self, verifier: str, k: int) -> dict[str, Any]:
        """The same checkpoint described in vllm-project/speculators' format."""
        hf = self.to_hf()
        layer_keys = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_hidden_layers",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "max_position_embeddings",
            "vocab_size",
            "hidden_act",
            "attention_bias",
            "model_type",
        )
        return {
            "architectures": [self.speculators_architecture],
            "speculators_model_type": self.speculators_type,
            "transformer_layer_config": {key: hf[key] for key in layer_keys},
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "speculators_config": {
                "algorithm": self.speculators_type,
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                "verifier": {"name_or_path": verifier},
            },
        }

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Eagle3Config:
        aux = (
            d.get("eagle_aux_hidden_state_layer_ids")
            or (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            or []
        )
        H = d["hidden_size"]
        return cls(
            hidden_size=H,
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim") or H // d["num_attention_heads"],
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or H,
            aux_layer_ids=list(aux),
            num_hidden_layers=d.get("num_hidden_layers", 1),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", 10000.0),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            norm_before_residual=d.get("norm_before_residual", False),
            attention_bias=d.get("attention_bias", False),
        )


class _FirstLayer(nn.Module):
    """Layer 0: attends over `[input_layernorm(embeds), hidden_norm(feature)]` (width 2H)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            2 * c.hidden_size,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.attention_bias,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, embeds, feature, cos, sin, attn_fn: AttnFn, idx: int) -> torch.Tensor:
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(feature)
        residual = h if self.norm_before_residual else feature
        x = residual + self.self_attn(torch.cat([e, h], dim=-1), cos, sin, attn_fn, idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Layer(nn.Module):
    """Layers >= 1: a plain pre-norm Llama decoder layer over the residual stream."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            c.hidden_size,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.attention_bias,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, attn_fn: AttnFn, idx: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_fn, idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    """`fc` + decoder layer(s) + `norm` + `lm_head` over the draft vocabulary.

    `embed_tokens` is the target's input embedding, frozen and never exported (engines share
    the target's); it is a buffer-like parameter with `requires_grad=False`.
    """

    config_class = Eagle3Config
    parallel = False  # chain drafting: one draft per forward

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            [_FirstLayer(c)] + [_Layer(c) for _ in range(c.num_hidden_layers - 1)]
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        # Draft vocabulary maps (convention 8). Identity until set from data.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # -- pieces the callers compose -------------------------------------------------------
    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux `[..., 3 * target_hidden]` -> step-0 carried feature `[..., H]`."""
        return self.fc(aux)

    def forward(
        self,
        input_ids: torch.Tensor,
        feature: torch.Tensor,
        positions: torch.Tensor,
        attn_fn: AttnFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over rows.

        input_ids `[B, T]` (token each row consumes), feature `[B, T, H]` (carried feature),
        positions `[B, T]` -> (normed `[B, T, H]` for `logits`, pre-norm `[B, T, H]` = the
        next step's carried feature).
        """
        cos, sin = self.rotary(positions)
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        x = self.layers[0](embeds, feature, cos, sin, attn_fn, 0)
        for i, layer in enumerate(self.layers[1:], start=1):
            x = layer(x, cos, sin, attn_fn, i)
        return self.norm(x), x

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """`[..., H]` -> draft-vocabulary logits `[..., draft_vocab_size]`."""
        return self.lm_head(normed)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (`i + d2t[i]`)."""
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the drafter owns: all weights except the shared target embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    # -- state-dict adapter to the serving layout -----------------------------------------
    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensor names engines load: a single layer is `midlayer.*` (the EAGLE-3 release
        layout SGLang and vLLM both read); stacks use `layers.N.*` (vLLM)."""
        sd = self.trainable_state_dict()
        if self.config.num_hidden_layers == 1:
            sd = {
                ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
                for k, v in sd.items()
            }
        return sd

    @staticmethod
    def from_serving_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
            for k, v in sd.items()
        }
