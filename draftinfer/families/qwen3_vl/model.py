"""Native Qwen3-VL target: our language model (KV cache, interleaved M-RoPE, DeepStack adds)
beside transformers' own vision tower, behind the text targets' interface.

    model = load_native_target("path/to/qwen3-vl", "cpu", torch.float32, max_batch=4)
    # What the engine, the plain baseline and the reference loop do (the prefill seam):
    plan = model.prefill_plan(ids, cache_pos, rows, [mm_inputs_0, None])  # per request
    inputs, rope_pos = plan.chunk(slice(0, 64))  # [3, B, 64]; the chunk's vision rows
    out = model(inputs, Slots(rows, cache_pos[:, :64], rope_pos), features)
    # The pieces it is built from:
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

Prefill seam: `prefill_plan(ids, cache_pos, rows, mm_inputs)` turns a batch of prompts and
each request's processor outputs (`MM_INPUT_KEYS`: pixel values, image grids,
`mm_token_type_ids`; None for text) into per-chunk inputs: per request and unpadded, the tower
runs once over its images and `get_rope_index` gives its table, placed in the batch's padding
layout; the request's `mrope_delta` is recorded for its cache row; `VisionPrefill.chunk` slices
the table and passes each chunk the vision rows of its own visual slots.

Feature taps: layer-input tap `j` is what decoder layer `j` receives, so for `1 <= j <= n_ds`
it includes `deepstack[j-1]` at visual slots (HF `hidden_states[j]` does not, DESIGN 3.2).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from draftinfer.conventions.slots import Slots
from draftinfer.files.errors import ConfigError
from draftinfer.models.decoder import Backbone, NativeCausalLM, NativeConfig, PrefillPlan
from draftinfer.models.kv_cache import resolve_attn_len, write_index
from draftinfer.models.target import FeatureSpec, TargetInputs, TargetOutput, as_inputs

EXTRA_KEYS = ("image_embeds", "deepstack", "visual_mask")
# A request's multimodal inputs (`Request.mm_inputs`, the processor's output for its prompt).
MM_INPUT_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")


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


class VisionPrefill(PrefillPlan):
    """A Qwen3-VL prefill: the `[3, n, P]` position table and the vision rows of the whole
    batch, sliced per chunk (an image may straddle a chunk boundary: each chunk passes the
    rows of its own visual slots, in the row-major order `extra` expects)."""

    def __init__(
        self,
        ids: torch.Tensor,  # [n, P]
        rope_pos: torch.Tensor,  # [3, n, P]
        visual_mask: torch.Tensor,  # [n, P] bool
        image_embeds: torch.Tensor | None,  # [N_vis, H], rows in row-major slot order
        deepstack: torch.Tensor | None,  # [n_ds, N_vis, H]
    ):
        super().__init__(ids)
        self.rope_pos, self.visual_mask = rope_pos, visual_mask
        self.image_embeds, self.deepstack = image_embeds, deepstack
        # Row of image_embeds each visual slot reads (row-major over the batch).
        flat = visual_mask.flatten().long()
        self.embed_row = (flat.cumsum(0) - 1).view(visual_mask.shape)  # [n, P]

    def chunk(self, cols: slice) -> tuple[TargetInputs, torch.Tensor]:
        mask = self.visual_mask[:, cols]
        extra: dict[str, torch.Tensor] = {}
        if bool(mask.any()):  # one host sync per chunk (prefill)
            index = self.embed_row[:, cols][mask]
            extra = {
                "visual_mask": mask,
                "image_embeds": self.image_embeds[index],
                "deepstack": self.deepstack[:, index],
            }
        return TargetInputs(self.ids[:, cols], extra), self.rope_pos[:, :, cols]


class Qwen3VLForConditionalGeneration(NativeCausalLM):
    """Qwen3-VL (dense): a Qwen3 decoder (q/k norm) with interleaved M-RoPE and DeepStack."""

    hf_model_types = ("qwen3_vl",)
    family = "qwen3_vl"

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

    def prefill_plan(
        self,
        ids: torch.Tensor,
        cache_pos: torch.Tensor,
        rows: torch.Tensor,
        mm_inputs: Sequence[dict | None] | None = None,
    ) -> VisionPrefill:
        """The prefill seam (`NativeCausalLM.prefill_plan`) for Qwen3-VL.

        ids `[n, P]` and cache_pos `[n, P]` in any padding layout (request b's tokens are the
        slots with `cache_pos >= 0`, at cache indices 0..P_b-1 in order); `mm_inputs[b]`:
        None (text) or `{"pixel_values" [sum(t*h*w), C*tp*p*p], "image_grid_thw" [n_img, 3],
        "mm_token_type_ids" [P_b0] (1 at image placeholders, 0 elsewhere)}` for the request's
        first `P_b0` tokens (tokens past them, e.g. a continuation the reference loop re-feeds,
        are text). Per request, unpadded: the vision tower runs once over its images and
        transformers' `get_rope_index` gives its `[3, P_b]` table, placed at its slots (padding
        slots at 0); its `mrope_delta` is recorded for cache row `rows[b]` (0 for text), so
        later slots sit at `cache_pos + mrope_delta` (`rope_positions`). One-line
        `ValueError`s name the request whose inputs do not fit its placeholders."""
        n, P = ids.shape
        mm_inputs = list(mm_inputs) if mm_inputs is not None else [None] * n
        if len(mm_inputs) != n:
            raise ValueError(f"{len(mm_inputs)} multimodal inputs for {n} requests")
        dev = ids.device
        table = torch.zeros(3, n, P, dtype=torch.long, device=dev)
        visual = torch.zeros(n, P, dtype=torch.bool, device=dev)
        deltas, embeds, deepstack = [], [], []
        for b, mm in enumerate(mm_inputs):
            live = (cache_pos[b] >= 0).nonzero()[:, 0]  # [P_b] slots of request b, in order
            if not torch.equal(cache_pos[b, live], torch.arange(len(live), device=dev)):
                raise ValueError(f"request {b}: a prefill starts at cache index 0, in order")
            tokens = ids[b, live]
            types, grid, pixels = self._request_mm(b, mm, len(live), dev)
            pos, delta = self.rope_index(
                tokens[None], mm_token_type_ids=types[None], image_grid_thw=grid
            )
            table[:, b, live] = pos[:, 0].to(dev)
            visual[b, live] = types == 1
            deltas.append(delta)
            if pixels is not None:
                e, ds = self.encode_images(pixels, grid)
                embeds.append(e)
                deepstack.append(ds)
        self.set_mrope_delta(rows, torch.cat(deltas))
        return VisionPrefill(
            ids,
            table,
            visual,
            torch.cat(embeds) if embeds else None,
            torch.cat(deepstack, dim=1) if deepstack else None,
        )

    def _request_mm(
        self, b: int, mm: dict | None, length: int, dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(mm_token_type_ids `[length]`, image_grid_thw `[n_img, 3]` or None, pixel_values or
        None) of request `b`, checked against each other (one-line `ValueError`s)."""
        types = torch.zeros(length, dtype=torch.long, device=dev)
        if mm is None:
            return types, None, None
        unknown = sorted(set(mm) - set(MM_INPUT_KEYS))
        missing = [k for k in MM_INPUT_KEYS if mm.get(k) is None]
        if unknown or missing:
            what = f"unknown key {unknown[0]!r}" if unknown else f"{missing[0]!r} missing"
            raise ValueError(f"request {b}: multimodal inputs need {MM_INPUT_KEYS}; {what}")
        given = torch.as_tensor(mm["mm_token_type_ids"], device=dev).long().flatten()
        if len(given) > length:
            raise ValueError(
                f"request {b}: mm_token_type_ids has {len(given)} entries for {length} tokens"
            )
        if bool((given == 2).any()):
            raise ValueError(f"request {b}: video inputs are not supported")
        types[: len(given)] = given
        grid = torch.as_tensor(mm["image_grid_thw"], device=dev).long().reshape(-1, 3)
        merge = self.config.hf_config.vision_config.spatial_merge_size
        expected = (grid.prod(-1) // merge**2).tolist()
        # Images are maximal runs of placeholders (the template brackets each with vision
        # start / end tokens), matched to the grids in order (as `get_rope_index` reads them).
        found = [len(list(g)) for t, g in itertools.groupby(types.tolist()) if t == 1]
        if found != expected:
            raise ValueError(
                f"request {b}: image placeholder runs of {found} tokens, but image_grid_thw "
                f"gives images of {expected} tokens"
            )
        return types, grid, torch.as_tensor(mm["pixel_values"]).to(dev)

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
        masks = self.layer_masks(slots.cache_pos, attn_len)
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
            x = layer(x, cos, sin, slots.rows, write_pos, masks[j], attn_len)
            if j < len(deepstack):
                x = torch.where(vmask, x + deepstack[j], x)
        out = self.head_output(x, taps, features, logit_index, rope_pos, embeds)
        out.mm_mask = None if visual is None else visual[0][..., 0]
        return out
