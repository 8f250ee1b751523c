"""The Qwen3-VL target family in training: transformers' own `Qwen3VLForConditionalGeneration`
(vision tower, DeepStack, interleaved M-RoPE) behind the target interface, image+text chat
data through its processor, and the serving facts of its drafters' exports.

What the frozen target returns for a batch (DESIGN 3.2, 3.3):
- RoPE positions `[3, B, T]`: transformers' own `get_rope_index` over the right-padded batch
  (`mm_token_type_ids` and the image grids), handed to the model as `position_ids`, so the
  table returned is the one the model ran at;
- layer-input taps from forward pre-hooks on the text decoder layers
  (`model.language_model.layers`): for `1 <= j <= n_ds` the input of layer `j` is HF's
  `hidden_states[j]` plus DeepStack level `j - 1` at visual slots (added after layer `j - 1`),
  which is what layer `j` receives and what vLLM's Qwen3-VL EAGLE-3 path feeds;
- input embeddings (pre-hook on layer 0): the token embeddings with the vision tower's
  embeddings scattered in at image slots;
- `mm_mask` `[B, T]`: the image/video placeholder slots (`mm_token_type_ids != 0`).

Drafters derive their architecture from `text_config` (`FrozenTarget.config`), so they get its
`rope_parameters` (interleaved `mrope_section`).
"""

from __future__ import annotations

import torch

from draftinfer.conventions.slots import Slots
from draftinfer.models.target import TargetInputs
from drafttrain.frozen.target import FrozenTarget


class Qwen3VLFrozenTarget(FrozenTarget):
    """`Qwen3VLForConditionalGeneration` with feature capture (module docstring)."""

    auto_class = "AutoModelForImageTextToText"
    input_keys = ("pixel_values", "image_grid_thw", "mm_token_type_ids")

    def text_config(self):
        return self.model.config.text_config

    def _types(self, inputs: TargetInputs) -> torch.Tensor:
        """`mm_token_type_ids [B, T]` (0 text, 1 image, 2 video); from the ids when absent."""
        types = inputs.extra.get("mm_token_type_ids")
        if types is not None:
            return types
        cfg, ids = self.model.config, inputs.input_ids
        return (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()

    def model_positions(self, inputs: TargetInputs, slots: Slots) -> torch.Tensor:
        """transformers' `get_rope_index` of the right-padded batch `[3, B, T]` (padding 0)."""
        pos, _ = self.model.model.get_rope_index(
            inputs.input_ids,
            mm_token_type_ids=self._types(inputs),
            image_grid_thw=inputs.extra.get("image_grid_thw"),
            attention_mask=(slots.cache_pos >= 0).long(),
        )
        return pos

    def multimodal_mask(self, inputs: TargetInputs, slots: Slots) -> torch.Tensor | None:
        if inputs.extra.get("pixel_values") is None:
            return None  # no encoder ran: every input embedding is the token's own
        return (self._types(inputs) != 0) & (slots.cache_pos >= 0)
