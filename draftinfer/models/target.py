"""The target interface (DESIGN 2.1 seam 2): one call both targets implement.

    out = target.forward(inputs, slots, features)   # -> TargetOutput

- the HF-hooked frozen target used in training (`drafttrain.frozen.target.FrozenTarget`) and
- the native target of the runner (`draftinfer.models`),

so drafter kinds and the engine never ask a target for kind-specific things (aux layer ids,
final norms): a drafter's config declares a `FeatureSpec`, the target returns exactly those
features, in that order, plus the RoPE positions it used and the input embeddings it built.

Feature vocabulary:
- *layer-input tap* `j`: the hidden state entering decoder layer `j` exactly as the layer
  receives it (pre-norm residual stream; 0 = the input embeddings). For text targets this is
  HF's `output_hidden_states[j]`; for Qwen3-VL it includes the DeepStack add (DESIGN 3.2).
- *final hidden*: the last decoder layer's output, before (`pre_norm`) or after
  (`post_norm`) the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from draftinfer.conventions.slots import Slots
from draftinfer.files.errors import ConfigError

FINAL_HIDDEN = ("pre_norm", "post_norm")


@dataclass(frozen=True)
class FeatureSpec:
    """What a drafter consumes from the target, concatenated in this order on the last axis:
    the inputs of layers `layer_inputs`, then the final hidden state (if `final_hidden`)."""

    layer_inputs: tuple[int, ...] = ()
    final_hidden: str | None = None  # None | "pre_norm" | "post_norm"

    def __post_init__(self) -> None:
        if self.final_hidden is not None and self.final_hidden not in FINAL_HIDDEN:
            raise ConfigError(
                f"final_hidden must be one of {FINAL_HIDDEN} or null, got {self.final_hidden!r}"
            )
        object.__setattr__(self, "layer_inputs", tuple(int(j) for j in self.layer_inputs))

    @property
    def count(self) -> int:
        return len(self.layer_inputs) + (self.final_hidden is not None)

    def width(self, hidden_size: int) -> int:
        return self.count * hidden_size

    def with_head_input(self) -> FeatureSpec:
        """This spec plus the *head input*: the target's final hidden state from which its
        distribution is recomputed (`lm_head(final_norm(h))` for `pre_norm`, `lm_head(h)` for
        `post_norm`). The spec's own final hidden is the head input when it has one, else the
        pre-norm one is appended last, so this spec's features are a prefix of the result.
        What a feature cache stores and what the runner emits for training (one definition)."""
        return FeatureSpec(self.layer_inputs, self.final_hidden or "pre_norm")

    def check(self, num_layers: int) -> None:
        """One-line `ConfigError` for a tap the target does not have."""
        bad = [j for j in self.layer_inputs if not 0 <= j < num_layers]
        if bad:
            raise ConfigError(
                f"feature taps {bad} out of range: the target has {num_layers} decoder layers "
                f"(layer inputs 0..{num_layers - 1})"
            )


@dataclass
class TargetInputs:
    """Token ids `[B, T]`, plus the family's extra inputs (for Qwen3-VL: pixel values, image
    grids, `mm_token_type_ids`), passed through untouched to the target family."""

    input_ids: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V] fp32 (or [B, T', V] with a logit index)
    features: torch.Tensor | None  # [B, T, FeatureSpec.width(H)] in the target dtype
    rope_pos: torch.Tensor  # [B, T] or [3, B, T]: the RoPE positions the target used
    inputs_embeds: torch.Tensor  # [B, T, H]: what entered decoder layer 0
    # [B, T] bool: slots whose input embedding is not the token's own (multimodal placeholders
    # filled by an encoder); None when there are none. Drafters read it (`draftinfer.conventions.window`).
    mm_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class TargetInfo:
    """Facts every consumer of a target may rely on, whatever its implementation."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    rope_axes: int = 1  # 3 for M-RoPE targets
    architecture: str = ""  # the HF architecture, e.g. "LlamaForCausalLM"
    family: str = ""  # the target family serving it (`draftinfer.families`), e.g. "causal_lm"


class Target(Protocol):
    info: TargetInfo

    def forward(
        self,
        inputs: TargetInputs | torch.Tensor,
        slots: Slots,
        features: FeatureSpec | None = None,
    ) -> TargetOutput: ...

    def rope_positions(self, cache_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """RoPE positions `[B, T]` / `[3, B, T]` of decode, verify and draft slots at
        `cache_pos [B, T]` of cache rows `rows [B]` (after the row's prefill)."""
        ...


def as_inputs(inputs: TargetInputs | torch.Tensor) -> TargetInputs:
    return inputs if isinstance(inputs, TargetInputs) else TargetInputs(inputs)
