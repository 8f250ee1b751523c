"""A tiny random Qwen3-VL for tests (DESIGN 5), shared by the native-target, runner and
training tests.

The config is a real Qwen3-VL's, shrunk: vision `out_hidden_size` = text hidden (64), three
DeepStack levels over a 3-block tower, interleaved `mrope_section [4, 2, 2]` at head_dim 16 (all
three axes get frequencies), `spatial_merge_size 2`, so a grid like `[1, 4, 6]` has 6 merged
tokens while positions advance by `max(4, 6) // 2 = 3`.

    path = save_tiny_vl(tmp_path)                 # HF `save_pretrained`, random weights (seed 0)
    ids = [21, 22, *image_tokens([1, 4, 6]), 23]  # vision start, 6 placeholders, vision end
    pix = image_pixels([[1, 4, 6]], seed=1)       # [t*h*w, PATCH_DIM] pixel patches
"""

from __future__ import annotations

from pathlib import Path

import torch

# Token ids of the tiny vocabulary (256): image / video placeholders, vision start / end.
IMG, VID, V_START, V_END = 250, 251, 252, 253
EOS = 2
VOCAB = 256
MERGE = 2  # vision spatial_merge_size
PATCH_DIM = 3 * 2 * 4 * 4  # channels * temporal_patch * patch**2
N_LAYERS, N_DS, H = 5, 3, 64


def tiny_vl_config():
    """transformers' `Qwen3VLConfig` of the tiny test target."""
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=H,
            intermediate_size=96,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            rope_parameters={**rope, "mrope_interleaved": True},
            tie_word_embeddings=False,  # the top-level flag is the one HF ties by
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            num_heads=4,
            intermediate_size=48,
            out_hidden_size=H,
            patch_size=4,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1, 2],
        ),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=V_START,
        vision_end_token_id=V_END,
        tie_word_embeddings=True,
        eos_token_id=EOS,
    )


def save_tiny_vl(path: str | Path, seed: int = 0) -> Path:
    """Save a random-init HF `Qwen3VLForConditionalGeneration` of `tiny_vl_config()` to `path`
    (safetensors + config.json); returns the path."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    path = Path(path)
    Qwen3VLForConditionalGeneration(tiny_vl_config()).save_pretrained(str(path))
    return path


def image_tokens(grid: list[int]) -> list[int]:
    """The prompt ids of one image: vision start, `t*h*w / merge**2` placeholders, vision end."""
    t, h, w = grid
    return [V_START] + [IMG] * (t * h * w // MERGE**2) + [V_END]


def image_pixels(grids: list[list[int]], seed: int) -> torch.Tensor | None:
    """Random pixel patches of a request's images `[sum(t*h*w), PATCH_DIM]` (None: no image)."""
    if not grids:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g)


def mm_inputs(ids: list[int], grids: list[list[int]], seed: int) -> dict | None:
    """A request's multimodal inputs in the runner's format (`draftinfer.decoding.engine.Request`):
    pixel patches, grids and `mm_token_type_ids` (1 at image placeholders); None without
    images."""
    if not grids:
        return None
    return {
        "pixel_values": image_pixels(grids, seed),
        "image_grid_thw": torch.tensor(grids),
        "mm_token_type_ids": [int(t == IMG) for t in ids],
    }
