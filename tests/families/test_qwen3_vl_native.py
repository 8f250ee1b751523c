"""The native Qwen3-VL target against transformers' `Qwen3VLForConditionalGeneration`.

A tiny random Qwen3-VL (DESIGN 5: vision `out_hidden_size` = text hidden, 3 DeepStack levels
over a 3-block tower, interleaved `mrope_section [4, 2, 2]` at head_dim 16, merge 2 with grids
whose `max(h, w) // 2` differs from the token count) is saved and loaded natively. In fp32 the
native prefill and 32 greedy decode steps (decode RoPE `cache_pos + mrope_delta`) equal HF's
logits for a padded batch of prompts with 0, 1 and 2 images; layer-input taps equal what each
HF decoder layer receives (S4: `hidden_states[j]` plus `deepstack[j-1]` at visual slots).
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.decoding.baseline import greedy_generate
from draftinfer.families.qwen3_vl.model import (
    Qwen3VLForConditionalGeneration,
    encode_images,
    rope_index,
)
from draftinfer.files.loading import load_native_target
from draftinfer.models.target import FeatureSpec, TargetInputs
from draftinfer.registry import FAMILIES
from tests.support.utils import assert_close
from tests.support.vl_fixtures import IMG, N_DS, N_LAYERS, PATCH_DIM, H, image_tokens, save_tiny_vl

DECODE_STEPS = 32


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return save_tiny_vl(tmp_path_factory.mktemp("qwen3_vl"))


@functools.lru_cache(maxsize=2)
def hf_model(path: str):
    from transformers import Qwen3VLForConditionalGeneration as HFQwen3VL

    model = HFQwen3VL.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval().requires_grad_(False)


# Three requests: text only; one image; two images (grids [1,4,6]: 6 tokens at positions
# advancing by 3; [1,4,4]: 4 tokens advancing by 2; [1,6,4]: 6 tokens advancing by 3).
GRIDS = [[], [[1, 4, 6]], [[1, 4, 4], [1, 6, 4]]]
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18, 19],
    [21, 22, 23, *image_tokens([1, 4, 6]), 24, 25, 26, 27],
    [31, 32, *image_tokens([1, 4, 4]), 33, 34, *image_tokens([1, 6, 4]), 35, 36, 37],
]


@functools.lru_cache(maxsize=1)
def pixels() -> list[torch.Tensor]:
    """Pixel patches of each request's images, `[sum(t*h*w), PATCH_DIM]` (None: no image)."""
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g) if grids else None
        for grids in GRIDS
    ]


def native(path, max_batch: int = 3, max_seq_len: int = 64):
    return load_native_target(path, "cpu", torch.float32, max_batch, max_seq_len)


def padded_batch(model):
    """(ids [B, T], cache_pos [B, T], rope_pos [3, B, T], mrope_delta [B], extra) of the three
    prompts right-padded to one prefill forward."""
    B, T = len(PROMPTS), max(map(len, PROMPTS))
    ids = torch.zeros(B, T, dtype=torch.long)
    cache_pos = torch.full((B, T), -1, dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        ids[b, : len(p)] = torch.tensor(p)
        cache_pos[b, : len(p)] = torch.arange(len(p))
    grid = torch.tensor([g for grids in GRIDS for g in grids])
    pix = torch.cat([p for p in pixels() if p is not None])
    rope_pos, delta = model.rope_index(ids, image_grid_thw=grid, attention_mask=cache_pos >= 0)
    image_embeds, deepstack = model.encode_images(pix, grid)
    extra = {"image_embeds": image_embeds, "deepstack": deepstack, "visual_mask": ids == IMG}
    return ids, cache_pos, rope_pos, delta, extra


def hf_inputs(b: int) -> dict:
    """HF keyword inputs of request `b` alone (unpadded)."""
    ids = torch.tensor([PROMPTS[b]])
    kw = {"input_ids": ids, "mm_token_type_ids": (ids == IMG).int()}
    if GRIDS[b]:
        kw.update(pixel_values=pixels()[b], image_grid_thw=torch.tensor(GRIDS[b]))
    return kw


def hf_greedy_logits(path, b: int, steps: int) -> list[torch.Tensor]:
    """HF logits `[V]` of request `b`: after its prompt, then after each of `steps` greedy
    tokens fed through HF's own cache and decode positions (its cached `rope_deltas`)."""
    hf = hf_model(str(path))
    hf.model.rope_deltas = None  # HF caches it on the model: a fresh request starts clean
    out = hf(**hf_inputs(b), use_cache=True)
    logits = [out.logits[0, -1]]
    # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns).
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    for _ in range(steps):
        tok = logits[-1].argmax()[None, None]
        out = hf(input_ids=tok, **{cache_kw: out.past_key_values}, use_cache=True)
        logits.append(out.logits[0, -1])
    return logits


def test_registered_and_config_facts(vl_dir):
    assert FAMILIES.native_class({"architectures": ["Qwen3VLForConditionalGeneration"]}) is (
        Qwen3VLForConditionalGeneration
    )
    model = native(vl_dir)
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_deepstack, c.head_dim) == (N_LAYERS, H, N_DS, 16)
    assert c.rope_scaling["mrope_section"] == [4, 2, 2] and c.qk_norm
    assert (
        model.info.rope_axes == 3 and model.info.architecture == "Qwen3VLForConditionalGeneration"
    )
    assert model.info.family == "qwen3_vl"
    assert model.lm_head.weight is model.embed_tokens.weight  # top-level tie_word_embeddings
    hf = hf_model(str(vl_dir))
    assert torch.equal(model.embed_tokens.weight, hf.get_input_embeddings().weight)
    assert not any(p.requires_grad for p in model.parameters())
    # A text-only request through the plain greedy loop (RoPE from `rope_positions`, delta 0).
    hf.model.rope_deltas = None
    ref = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False)
    assert greedy_generate(model, [PROMPTS[0]], 8) == [ref[0, len(PROMPTS[0]) :].tolist()]
    # bf16: the vision tower and the decoder both cast; an image forward stays finite.
    bf = load_native_target(vl_dir, "cpu", torch.bfloat16, 1, 32)
    grid = torch.tensor(GRIDS[1])
    embeds, ds = bf.encode_images(pixels()[1], grid)
    assert embeds.dtype == ds.dtype == torch.bfloat16
    ids = torch.tensor([PROMPTS[1]])
    pos, _ = bf.rope_index(ids, image_grid_thw=grid)
    extra = {"image_embeds": embeds, "deepstack": ds, "visual_mask": ids == IMG}
    out = bf(
        TargetInputs(ids, extra), Slots(torch.tensor([0]), torch.arange(ids.shape[1])[None], pos)
    )
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()


def test_rope_index_is_transformers_table(vl_dir):
    model = native(vl_dir)
    ids, cache_pos, rope_pos, delta, _ = padded_batch(model)
    mask = cache_pos >= 0
    grid = torch.tensor([g for grids in GRIDS for g in grids])
    ref_pos, ref_delta = hf_model(str(vl_dir)).model.get_rope_index(
        ids, (ids == IMG).int(), grid, attention_mask=mask
    )
    assert torch.equal(rope_pos, ref_pos) and delta.tolist() == ref_delta[:, 0].tolist()
    pos2, delta2 = rope_index(model.config.hf_config, ids, (ids == IMG).int(), grid, mask)
    assert torch.equal(pos2, rope_pos) and torch.equal(delta2, delta)
    # Hand-checked: the [1,4,6] image of request 1 starts at 4 (after 3 text + vision start);
    # its 2x3 merged grid spans H 4..5, W 4..6; the text after it resumes at 4 + max(4,6)//2.
    r1 = rope_pos[:, 1, 4:10]
    assert r1.tolist() == [[4] * 6, [4, 4, 4, 5, 5, 5], [4, 5, 6, 4, 5, 6]]
    assert rope_pos[:, 1, 10:12].tolist() == [[7, 8]] * 3  # vision end at 7, then text
    # delta = max position + 1 - length: 12 - 15 (request 1), 16 - 21 (request 2).
    assert delta.tolist() == [0, -3, -5]


def test_encode_images_is_transformers_tower(vl_dir):
    """The rows `extra` carries: HF's merged image embeddings and DeepStack features (all
    three images in one call, rows in image order), from the native target's own copy of the
    tower or from HF's."""
    model, hf = native(vl_dir), hf_model(str(vl_dir))
    grid = torch.tensor([g for grids in GRIDS for g in grids])
    pix = torch.cat([p for p in pixels() if p is not None])
    ref = hf.model.get_image_features(pix, grid)
    ref_embeds = torch.cat(ref.pooler_output)
    ref_ds = torch.stack([torch.cat(level) for level in ref.deepstack_features])
    for embeds, ds in [model.encode_images(pix, grid), encode_images(hf.model.visual, pix, grid)]:
        assert embeds.shape == (4 + 6 + 6, H) and ds.shape == (N_DS, 16, H)
        assert_close(embeds, ref_embeds)
        assert_close(ds, ref_ds)


def test_prefill_and_greedy_decode_equal_hf(vl_dir):
    """Padded batch of 0/1/2-image prompts: prefill logits, then 32 greedy steps through the
    native cache at RoPE `cache_pos + mrope_delta`, each equal to HF's (per request, its own
    cache and positions)."""
    model = native(vl_dir)
    ids, cache_pos, rope_pos, delta, extra = padded_batch(model)
    rows = torch.arange(len(PROMPTS))
    lens = torch.tensor([len(p) for p in PROMPTS])
    out = model(TargetInputs(ids, extra), Slots(rows, cache_pos, rope_pos))
    assert torch.equal(out.rope_pos, rope_pos)
    logits = out.logits[rows, lens - 1]  # [B, V]
    refs = [hf_greedy_logits(vl_dir, b, DECODE_STEPS) for b in range(len(PROMPTS))]
    model.set_mrope_delta(rows, delta)
    for step in range(DECODE_STEPS + 1):
        for b in range(len(PROMPTS)):
            assert_close(logits[b], refs[b][step].float())
        if step == DECODE_STEPS:
            break
        tok = logits.argmax(-1)[:, None]  # [B, 1]
        pos = (lens + step)[:, None]  # [B, 1] cache index of the token fed
        rope = (pos + delta[:, None])[None].expand(3, -1, -1)  # what the runner passes
        assert torch.equal(model.rope_positions(pos, rows), rope)
        logits = model(tok, Slots(rows, pos, rope)).logits[:, 0]
    # The image rows' positions really are shifted: with delta 0 the decode logits differ.
    assert (delta[1:] != 0).all()


def test_chunked_prefill_splitting_an_image(vl_dir):
    """Request 2 prefilled in chunks that cut its second image: each chunk passes the
    `image_embeds` / `deepstack` rows of its own visual slots; logits equal one prefill."""
    model = native(vl_dir)
    ids, cache_pos, rope_pos, _, extra = padded_batch(model)
    full = model(TargetInputs(ids, extra), Slots(torch.arange(3), cache_pos, rope_pos)).logits
    n = len(PROMPTS[2])
    first = int(extra["visual_mask"][:2].sum())  # rows of requests 0 and 1 come first
    vis = extra["visual_mask"][2]
    got = []
    for lo, hi in [(0, 12), (12, n)]:  # slot 12 is inside the second image
        assert vis[lo:hi].any()
        a, k = first + int(vis[:lo].sum()), int(vis[lo:hi].sum())
        chunk = {
            "image_embeds": extra["image_embeds"][a : a + k],
            "deepstack": extra["deepstack"][:, a : a + k],
            "visual_mask": vis[None, lo:hi],
        }
        slots = Slots(torch.tensor([1]), torch.arange(lo, hi)[None], rope_pos[:, 2:3, lo:hi])
        got.append(model(TargetInputs(ids[2:3, lo:hi], chunk), slots).logits[0])
    assert_close(torch.cat(got), full[2, :n])


def layer_inputs_hf(path, b: int) -> tuple[list[torch.Tensor], tuple, torch.Tensor]:
    """(what each HF decoder layer receives (forward pre-hooks), HF `hidden_states`,
    HF's DeepStack features `[n_ds, N_vis, H]` of request `b`)."""
    hf = hf_model(str(path))
    hf.model.rope_deltas = None
    received: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, args, kw: received.append(args[0] if args else kw["hidden_states"]),
            with_kwargs=True,
        )
        for layer in hf.model.language_model.layers
    ]
    try:
        out = hf(**hf_inputs(b), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    kw = hf_inputs(b)
    ds = torch.zeros(N_DS, 0, H)
    if GRIDS[b]:
        feats = hf.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"])
        ds = torch.stack([torch.cat(level) for level in feats.deepstack_features])
    return received, out.hidden_states, ds


def expected_tap(hidden_states, deepstack, visual, j: int, with_deepstack: bool = True):
    """Tap `j` built from HF's outputs: `hidden_states[j]`, plus `deepstack[j-1]` at the
    visual slots for `1 <= j <= n_ds` (DESIGN 3.2). `with_deepstack=False` is the other
    convention (HF's recorded layer outputs as is, what AngelSlim trains on)."""
    ref = hidden_states[j][0].clone()
    if with_deepstack and 1 <= j <= len(deepstack):
        ref[visual] = ref[visual] + deepstack[j - 1]
    return ref


def native_taps(model):
    ids, cache_pos, rope_pos, _, extra = padded_batch(model)
    taps = FeatureSpec(tuple(range(N_LAYERS)))
    out = model(TargetInputs(ids, extra), Slots(torch.arange(3), cache_pos, rope_pos), taps)
    return out, extra["visual_mask"]


def test_s4_taps_are_what_each_layer_receives(vl_dir):
    model = native(vl_dir)
    out, vmask = native_taps(model)
    for b, prompt in enumerate(PROMPTS):
        n = len(prompt)
        received, hs, ds = layer_inputs_hf(vl_dir, b)
        visual = vmask[b, :n]
        assert_close(out.inputs_embeds[b, :n], hs[0][0])  # embeddings after the image scatter
        for j in range(N_LAYERS):
            tap = out.features[b, :n, j * H : (j + 1) * H]
            assert_close(tap, received[j][0])
            assert_close(tap, expected_tap(hs, ds, visual, j))
            if GRIDS[b] and 1 <= j <= N_DS:  # the add is real, not a rounding-level change
                assert (tap[visual] - hs[j][0][visual]).abs().max() > 1e-2


@pytest.mark.parametrize("j", range(1, N_DS + 1))
def test_s4_fails_with_hf_hidden_states_as_taps(vl_dir, j):
    """The injected wrong convention (tap j = HF `hidden_states[j]`, no DeepStack add) fails
    the S4 comparison at every DeepStack tap of a request with images, and passes for a
    text-only request (where both conventions agree)."""
    model = native(vl_dir)
    out, vmask = native_taps(model)
    tap = out.features[..., j * H : (j + 1) * H]
    for b in (1, 2):
        n = len(PROMPTS[b])
        _, hs, ds = layer_inputs_hf(vl_dir, b)
        wrong = expected_tap(hs, ds, vmask[b, :n], j, with_deepstack=False)
        with pytest.raises(AssertionError):
            assert_close(tap[b, :n], wrong)
    _, hs, ds = layer_inputs_hf(vl_dir, 0)
    n = len(PROMPTS[0])
    assert_close(tap[0, :n], expected_tap(hs, ds, vmask[0, :n], j, with_deepstack=False))


def test_bad_visual_inputs_are_one_line_errors(vl_dir):
    model = native(vl_dir)
    ids, cache_pos, rope_pos, _, extra = padded_batch(model)
    slots = Slots(torch.arange(3), cache_pos, rope_pos)
    cases = [
        ({k: v for k, v in extra.items() if k != "deepstack"}, "'deepstack' missing"),
        ({**extra, "pixel_values": ids}, "unknown Qwen3-VL input 'pixel_values'"),
        ({**extra, "image_embeds": extra["image_embeds"][1:]}, r"image_embeds must be \[16, 64\]"),
        ({**extra, "deepstack": extra["deepstack"][:2]}, r"deepstack \[3, 16, 64\]"),
        ({**extra, "visual_mask": extra["visual_mask"].int()}, "visual_mask must be bool"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            model(TargetInputs(ids, bad), slots)
    with pytest.raises(ValueError, match="need rope_pos"):
        model(TargetInputs(ids, extra), Slots(torch.arange(3), cache_pos))
