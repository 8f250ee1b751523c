"""Native Qwen3-VL target: our language model (KV cache, interleaved M-RoPE, DeepStack adds)
beside transformers' own vision tower, behind the text targets' interface.

    model = load_native_target("path/to/qwen3-vl", "cpu", torch.float32, max_batch=4)
    image_embeds, deepstack = model.encode_images(pixel_values, image_grid_thw)
    pos, delta = model.rope_index(ids, image_grid_thw=image_grid_thw)  # [3, B, T], [B]
    extra = {"image_embeds": image_embeds, "deepstack": deepstack, "visual_mask": ids == image_id}
    out = model(TargetInputs(ids, extra), Slots(rows, cache_pos, rope_pos=pos), features)

Module names equal Hugging Face's `Qwen3VLForConditionalGeneration`: the decoder lives at
`model.language_model.*`, the vision tower (transformers' `Qwen3VLVisionModel`, run as is) at
`model.visual.*`, the head at `lm_head.*`, so the whole safetensors checkpoint loads by name.

Family inputs (`TargetInputs.extra`), all three or none:
- `visual_mask [B, T]` bool: the image/video placeholder slots of this forward (never a
  padding slot);
- `image_embeds [N_vis, H]`: the vision tower's merged output, one row per True slot of
  `visual_mask` in row-major (batch, then slot) order, exactly the rows HF `masked_scatter`s
  into the input embeddings;
- `deepstack [n_ds, N_vis, H]`: the vision tower's DeepStack features, same rows; level `i` is
  added to the hidden state after decoder layer `i` at the visual slots (HF
  `Qwen3VLTextModel._deepstack_process`).
A chunk that holds part of an image passes that part's rows. `encode_images` builds the rows
of whole images, once per image.

Positions: the model reads only `slots.rope_pos` (`[3, B, T]`, T/H/W rows). Prefill passes
the target's own table (`rope_index`, transformers' `get_rope_index`); decode, verify and
draft slots sit at `cache_pos + mrope_delta` on all three axes, which `rope_positions` gives
for a cache row once `set_mrope_delta` recorded that row's delta (0 until then).

Feature taps: layer-input tap `j` is what decoder layer `j` receives, so for `1 <= j <= n_ds`
it includes `deepstack[j-1]` at visual slots (HF `hidden_states[j]` does not, DESIGN 3.2).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draftinfer.errors import ConfigError
from draftinfer.kv_cache import resolve_attn_len, visibility_mask, write_index
from draftinfer.models.llama import Backbone, NativeCausalLM, NativeConfig
from draftinfer.slots import Slots
from draftinfer.target import FeatureSpec, TargetInputs, TargetOutput, as_inputs

EXTRA_KEYS = ("image_embeds", "deepstack", "visual_mask")


@dataclass
class Qwen3VLNativeConfig(NativeConfig):
    """`NativeConfig` of the text decoder plus the multimodal facts."""

    hf_config: Any = None  # transformers' Qwen3VLConfig (builds the vision tower, rope index)
    image_token_id: int = -1
    video_token_id: int = -1
    num_deepstack: int = 0  # n_ds = len(vision_config.deepstack_visual_indexes)


def _vision_tower(hf_config: Any) -> nn.Module:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return Qwen3VLVisionModel._from_config(hf_config.vision_config)


class _Qwen3VLModel(nn.Module):
    """HF's `model.*`: the decoder (`language_model`) and the vision tower (`visual`)."""

    def __init__(self, cfg: Qwen3VLNativeConfig):
        super().__init__()
        self.language_model = Backbone(cfg)
        self.visual = _vision_tower(cfg.hf_config)

    # The text targets' names, so the shared code (caches, tied head, drafters) finds them.
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def norm(self) -> nn.Module:
        return self.language_model.norm


def rope_index_fn(hf_config: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """transformers' own `Qwen3VLModel.get_rope_index`, bound to a weightless (meta-device)
    model of `hf_config`: the table is the target's own whatever the transformers version
    (0.1 s to build at 8B shapes)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    with torch.device("meta"):
        return Qwen3VLModel(copy.deepcopy(hf_config)).get_rope_index


@torch.no_grad()
def encode_images(
    visual: nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run transformers' Qwen3-VL vision tower once over the images.

    pixel_values `[sum(t*h*w), C * temporal_patch * patch**2]`, image_grid_thw `[n_images, 3]`
    -> (image_embeds `[N_vis, H]`, deepstack `[n_ds, N_vis, H]`), `N_vis = sum(t*h*w) /
    merge**2`, rows in image order (the format of `extra`, module docstring)."""
    dtype = next(visual.parameters()).dtype
    out = visual(pixel_values.to(dtype), grid_thw=image_grid_thw, return_dict=True)
    return out.pooler_output, torch.stack(list(out.deepstack_features))


def rope_index(
    hf_config: Any,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `get_rope_index` for a batch: (positions `[3, B, T]`, mrope_delta `[B]`).

    input_ids `[B, T]`; `mm_token_type_ids [B, T]` (0 text, 1 image, 2 video; None: derived
    from the image/video token ids); `attention_mask [B, T]` marks real tokens (padding gets
    position 0); `fn`: a `rope_index_fn(hf_config)` built once. Decode slots of row b then
    sit at `cache_pos + mrope_delta[b]`."""
    if mm_token_type_ids is None:
        mm_token_type_ids = (input_ids == hf_config.image_token_id).int() + 2 * (
            input_ids == hf_config.video_token_id
        ).int()
    pos, delta = (fn or rope_index_fn(hf_config))(
        input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        attention_mask=attention_mask,
    )
    return pos, delta.reshape(-1)


class Qwen3VLForConditionalGeneration(NativeCausalLM):
    """Qwen3-VL (dense): a Qwen3 decoder (q/k norm) with interleaved M-RoPE and DeepStack."""

    hf_model_types = ("qwen3_vl",)

    def __init__(self, config: Qwen3VLNativeConfig):
        super().__init__(config)
        self.model = _Qwen3VLModel(config)
        self.tie_weights()
        self.mrope_delta: torch.Tensor | None
        self.register_buffer("mrope_delta", None, persistent=False)
        self._rope_index_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def config_from_hf(cls, hf: Any, eos_token_ids: list[int]) -> Qwen3VLNativeConfig:
        text, vision = hf.text_config, hf.vision_config
        name = cls.__name__
        if vision.out_hidden_size != text.hidden_size:
            raise ConfigError(
                f"{name}: vision out_hidden_size {vision.out_hidden_size} != text hidden_size "
                f"{text.hidden_size}"
            )
        n_ds = len(vision.deepstack_visual_indexes)
        if n_ds > text.num_hidden_layers:
            raise ConfigError(
                f"{name}: {n_ds} DeepStack levels but only {text.num_hidden_layers} text layers"
            )
        base = super().config_from_hf(text, eos_token_ids)
        if base.rope_scaling is None or "mrope_section" not in base.rope_scaling:
            raise ConfigError(f"{name}: text_config.rope_parameters has no mrope_section")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(NativeConfig)}
        # The head is tied by the top-level flag (HF `_tied_weights_keys` of the VL model).
        fields["tie_word_embeddings"] = bool(getattr(hf, "tie_word_embeddings", False))
        return Qwen3VLNativeConfig(
            **fields,
            hf_config=hf,
            image_token_id=int(hf.image_token_id),
            video_token_id=int(hf.video_token_id),
            num_deepstack=n_ds,
        )

    @classmethod
    def block_flags(cls, attention_bias: bool, mlp_bias: bool) -> tuple[bool, bool, bool, bool]:
        return attention_bias, attention_bias, False, True  # Qwen3 decoder layer

    def init_rope(self, device: torch.device | str) -> None:
        super().init_rope(device)
        # The tower's rotary table is a non-persistent buffer: rebuild it after a meta build.
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionRotaryEmbedding

        visual = self.model.visual
        visual.rotary_pos_emb = Qwen3VLVisionRotaryEmbedding(visual.config).to(device)

    def setup_caches(self, max_batch: int, max_seq_len: int) -> None:
        super().setup_caches(max_batch, max_seq_len)
        device = self.model.embed_tokens.weight.device
        self.mrope_delta = torch.zeros(max_batch, dtype=torch.long, device=device)

    # ---- positions and vision inputs ----------------------------------------------------
    def set_mrope_delta(self, rows: torch.Tensor, delta: torch.Tensor) -> None:
        """Record the `mrope_delta [len(rows)]` of the requests now in cache rows `rows`
        (from `rope_index` at prefill; 0 for text-only requests)."""
        self.mrope_delta[rows] = delta.to(self.mrope_delta)

    def rope_positions(self, cache_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`[3, B, T]`: `cache_pos + mrope_delta[row]` on all three axes (padding slots at
        `mrope_delta`), the positions of every slot after the row's prefill."""
        pos = cache_pos.clamp(min=0) + self.mrope_delta[rows][:, None]
        return pos[None].expand(3, *pos.shape)

    def encode_images(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(image_embeds `[N_vis, H]`, deepstack `[n_ds, N_vis, H]`) of this target's tower."""
        return encode_images(self.model.visual, pixel_values, image_grid_thw)

    def rope_index(
        self, input_ids: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_index(self.config.hf_config, input_ids, ...)`: ([3, B, T], mrope_delta [B])."""
        if self._rope_index_fn is None:
            self._rope_index_fn = rope_index_fn(self.config.hf_config)
        return rope_index(self.config.hf_config, input_ids, fn=self._rope_index_fn, **kwargs)

    def _visual_inputs(
        self, extra: dict[str, torch.Tensor], B: int, T: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(visual_mask [B, T, 1], image_embeds [N_vis, H], deepstack [n_ds, N_vis, H]) or
        None; one-line `ValueError`s for an inconsistent set (one host sync: prefill only)."""
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"unknown Qwen3-VL input {unknown[0]!r} (known: {EXTRA_KEYS})")
        if not extra:
            return None
        missing = [k for k in EXTRA_KEYS if k not in extra]
        if missing:
            raise ValueError(f"Qwen3-VL inputs need all of {EXTRA_KEYS}; {missing[0]!r} missing")
        mask, embeds, ds = extra["visual_mask"], extra["image_embeds"], extra["deepstack"]
        H, n_ds = self.config.hidden_size, self.config.num_deepstack
        if mask.shape != (B, T) or mask.dtype != torch.bool:
            raise ValueError(
                f"visual_mask must be bool [{B}, {T}], got {mask.dtype} {tuple(mask.shape)}"
            )
        n_vis = int(mask.sum())
        if embeds.shape != (n_vis, H) or ds.shape != (n_ds, n_vis, H):
            raise ValueError(
                f"visual_mask has {n_vis} visual slots: image_embeds must be [{n_vis}, {H}] "
                f"(got {tuple(embeds.shape)}), deepstack [{n_ds}, {n_vis}, {H}] "
                f"(got {tuple(ds.shape)})"
            )
        return mask[..., None], embeds, ds

    # ---- forward (the target interface) -------------------------------------------------
    def forward(
        self,
        inputs: TargetInputs | torch.Tensor,
        slots: Slots,
        features: FeatureSpec | None = None,
        *,
        logit_index: torch.Tensor | None = None,
    ) -> TargetOutput:
        """`NativeCausalLM.forward` with the vision rows: input embeddings at visual slots are
        the image embeddings, and DeepStack level `i` is added after decoder layer `i` at those
        slots. `slots.rope_pos` `[3, B, T]` is required when `inputs` carry visual rows (their
        positions come from the `rope_index` table); without it `rope_positions` is used."""
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_caches(max_batch, max_seq_len) before forward")
        c = self.config
        inputs = as_inputs(inputs)
        ids = inputs.input_ids
        B, T = ids.shape
        visual = self._visual_inputs(inputs.extra, B, T)
        if slots.attn_len is None:
            self._check_rows(slots)
        attn_len = resolve_attn_len(slots, self.max_seq_len)
        if features is not None:
            features.check(c.num_layers)
        ids = torch.where(slots.cache_pos >= 0, ids, torch.zeros_like(ids))
        write_pos = write_index(slots.cache_pos, self.max_seq_len)
        mask = visibility_mask(slots.cache_pos, attn_len, c.num_heads // c.num_kv_heads)
        rope_pos = slots.rope_pos
        if rope_pos is None:
            if visual is not None:
                raise ValueError("slots with image rows need rope_pos (the rope_index table)")
            rope_pos = self.rope_positions(slots.cache_pos, slots.rows)
        cos, sin = self.rotary(rope_pos)  # [B, T, head_dim] fp32
        embeds = self.model.embed_tokens(ids)  # [B, T, H]
        deepstack: list[torch.Tensor] = []
        if visual is not None:
            vmask, image_embeds, ds = visual
            embeds = embeds.masked_scatter(vmask, image_embeds.to(embeds.dtype))
            # Each level scattered to a dense [B, T, H] once: the adds need no boolean indexing.
            zeros = torch.zeros_like(embeds)
            deepstack = [zeros.masked_scatter(vmask, level.to(embeds.dtype)) for level in ds]
        x = embeds
        taps: dict[int, torch.Tensor] = {}
        wanted = set(features.layer_inputs) if features is not None else set()
        for j, layer in enumerate(self.model.layers):
            if j in wanted:
                taps[j] = x  # what layer j receives: DeepStack add of layer j-1 included
            x = layer(x, cos, sin, slots.rows, write_pos, mask, attn_len)
            if j < len(deepstack):
                x = torch.where(vmask, x + deepstack[j], x)
        return self.head_output(x, taps, features, logit_index, rope_pos, embeds)
