"""Qwen3-VL on the training side (issue 9, build items 1, 2, 3, 6): the family seam, the
processor inputs and assistant-only loss masks of image+text chat, collation and sharding of
pixel inputs, the frozen target's taps / positions / multimodal mask against transformers (S4,
M1 on the training side), the drafters' M-RoPE and shifted vision embeddings (S9 on the
training side), the export's vLLM fields and the cache refusal.

Everything runs on a tiny random Qwen3-VL with a real processor layout and a chat template that
renders like the released one (tests/support/vl_data_fixtures.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from draftinfer.evaluation.chat import normalize_messages, row_messages
from draftinfer.families.qwen3_vl.processor import conversation_inputs, load_processor
from draftinfer.files.errors import ConfigError, DataError
from draftinfer.models.target import FeatureSpec
from drafttrain.frozen.head import target_logits
from drafttrain.jobs.config import DataConfig, TargetConfig
from tests.support.utils import assert_close
from tests.support.vl_data_fixtures import (
    IM_END,
    IMAGE_PAD,
    N_DS,
    N_LAYERS,
    PATCH_DIM,
    QWEN3_VL_TEMPLATE,
    H,
    image,
    make_vl_target,
    text,
    write_processor_files,
    write_vl_chat,
)


@pytest.fixture(autouse=True, scope="module")
def _two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(min(2, n))
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vl")
    target = make_vl_target(root / "target")
    data = write_vl_chat(root / "data")
    return {"root": root, "target": str(target), "data": str(data)}


@functools.lru_cache(maxsize=2)
def processor(path: str):
    return load_processor(path)


@functools.lru_cache(maxsize=1)
def frozen(path: str):
    from drafttrain.families.qwen3_vl.target import Qwen3VLFrozenTarget

    cfg = TargetConfig(name_or_path=path, dtype="float32", attn_implementation="eager")
    return Qwen3VLFrozenTarget(cfg, torch.device("cpu"))


def vl_split(vl, split="train", **kw):
    from drafttrain.families.qwen3_vl.data import VLChatData

    cfg = DataConfig(
        path=vl["data"], split=split, cache_dir=str(vl["root"] / "cache"), batch_size=4, **kw
    )
    return VLChatData(processor(vl["target"])).tokenize(cfg)


def conversation(*images: str, system: bool = True) -> list[dict]:
    msgs = [
        {"role": "user", "content": [*map(image, images), text("What colour is the box?")]},
        {"role": "assistant", "content": [text("The box is red.")]},
        {"role": "user", "content": [text("Thanks!")]},
        {"role": "assistant", "content": [text("You are welcome.")]},
    ]
    if system:
        msgs.insert(0, {"role": "system", "content": "You are a helpful model."})
    return msgs


# --------------------------------------------------------------------------- seams


def test_family_is_chosen_by_architecture(vl, tiny_llama3_dir):
    from drafttrain.families.causal_lm import CausalLMTrainFamily
    from drafttrain.families.qwen3_vl import Qwen3VLTrainFamily
    from drafttrain.registry import target_family

    assert isinstance(target_family(vl["target"]), Qwen3VLTrainFamily)
    text_family = target_family(str(tiny_llama3_dir))
    assert type(text_family) is CausalLMTrainFamily and text_family.feature_cache
    assert not Qwen3VLTrainFamily.feature_cache


def test_normalize_keeps_image_parts_and_text_rows_unchanged():
    text_row = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "yo"},
    ]
    assert normalize_messages(text_row) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    # Arrow fills absent keys with None: a text part's `image: None` must not make it an image.
    parts = [
        {"type": "image", "image": "a.png", "text": None},
        {"type": "text", "text": "x", "image": None},
    ]
    out = normalize_messages([{"role": "user", "content": parts}])
    assert out[0]["content"] == [{"type": "image", "image": "a.png"}, {"type": "text", "text": "x"}]


def test_row_messages_inlines_trl_images():
    row = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "index": 1, "text": None},
                    {"type": "image", "index": None, "text": None},
                    {"type": "text", "text": "q", "index": None},
                ],
            }
        ],
        "images": ["A", "B"],
    }
    parts = row_messages(row)[0]["content"]
    assert [p.get("image") for p in parts] == ["B", "A", None]
    with pytest.raises(DataError, match="image 5 of a row with 2"):
        row_messages(
            {**row, "messages": [{"role": "user", "content": [{"type": "image", "index": 5}]}]}
        )


def test_load_processor_missing_is_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        load_processor(str(tmp_path / "nothing"))
    assert "cannot load the processor" in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- data


def test_conversation_inputs_expand_images(vl):
    proc = processor(vl["target"])
    tok = proc.tokenizer
    base = Path(vl["data"])
    msgs = conversation("images/train_0003_0.png", "images/train_0003_1.png")
    enc = conversation_inputs(proc, msgs, add_generation_prompt=False, base_dir=base, sample="s")
    grid = enc["image_grid_thw"].tolist()
    assert grid == [[1, 4, 6], [1, 6, 4]]  # 16x24 and 24x16 px at patch 4
    assert enc["pixel_values"].shape == (24 + 24, PATCH_DIM)
    img = tok.convert_tokens_to_ids(IMAGE_PAD)
    ids = enc["input_ids"]
    assert sum(t == img for t in ids) == 6 + 6  # t*h*w / merge**2 per image
    assert enc["mm_token_type_ids"] == [int(t == img) for t in ids]
    # The same ids as the template text with each pad repeated, tokenized plainly.
    rendered = proc.apply_chat_template(msgs, tokenize=False)
    expanded = rendered.replace(IMAGE_PAD, "\0", 1).replace(IMAGE_PAD, IMAGE_PAD * 6)
    expanded = expanded.replace("\0", IMAGE_PAD * 6)
    assert ids == tok(expanded, add_special_tokens=False)["input_ids"]
    gen = conversation_inputs(proc, msgs[:2], add_generation_prompt=True, base_dir=base, sample="s")
    assert tok.decode(gen["input_ids"]).endswith(
        "What colour is the box?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_image_refs_path_pil_and_datasets_bytes_agree(vl):
    from PIL import Image

    proc = processor(vl["target"])
    path = Path(vl["data"]) / "images/train_0000_0.png"
    refs = [
        "images/train_0000_0.png",
        str(path),
        Image.open(path),
        {"bytes": path.read_bytes(), "path": None},
        {"bytes": None, "path": str(path)},
    ]
    outs = [
        conversation_inputs(
            proc,
            conversation(r),
            add_generation_prompt=False,
            base_dir=Path(vl["data"]),
            sample="s",
        )
        for r in refs
    ]
    for o in outs[1:]:
        assert o["input_ids"] == outs[0]["input_ids"]
        assert torch.equal(o["pixel_values"], outs[0]["pixel_values"])


def generation_mask(vl, tmp_path, msgs, counts: list[int]) -> list[int]:
    """The oracle: transformers' own assistant mask (`{% generation %}` markers) of a template
    that renders identically, with image pads expanded (mask 0) as the processor does."""
    marked = QWEN3_VL_TEMPLATE.replace(
        "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content is string %}"
        "{{- message.content }}{%- else %}{%- for content_item",
        "{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}"
        "{%- if message.content is string %}{{- message.content }}{%- else %}"
        "{%- for content_item",
    ).replace(
        "{{- content_item.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}",
        "{{- content_item.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>' }}"
        "{%- endgeneration %}{{- '\\n' }}",
    )
    assert marked.count("generation %}") == 2
    tok = write_processor_files(tmp_path / "marked", marked)
    shown = [
        {
            **m,
            "content": [
                {**p, "image": "x"} if p.get("type") == "image" else p for p in m["content"]
            ],
        }
        if isinstance(m["content"], list)
        else m
        for m in msgs
    ]
    assert tok.apply_chat_template(shown, tokenize=False, chat_template=marked) == processor(
        vl["target"]
    ).apply_chat_template(shown, tokenize=False)
    enc = tok.apply_chat_template(
        shown,
        chat_template=marked,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    img = tok.convert_tokens_to_ids(IMAGE_PAD)
    counts = iter(counts)
    mask = []
    for t, m in zip(enc["input_ids"], enc["assistant_masks"]):
        mask += [0] * next(counts) if t == img else [m]
    return mask


def test_loss_mask_token_by_token(vl, tmp_path):
    """R2 for the VL template: the mask found by spans on the processor's rendering equals
    transformers' own `{% generation %}` mask, token by token, with images expanded."""
    from drafttrain.families.qwen3_vl.data import tokenize_vl_conversation

    proc = processor(vl["target"])
    msgs = conversation("images/train_0003_0.png", "images/train_0003_1.png")
    msgs[4]["content"] = [text("Here: "), text("You are welcome.")]  # list content, 2 parts
    msgs.append({"role": "user", "content": [image("images/train_0000_0.png"), text("And this?")]})
    msgs.append({"role": "assistant", "content": "Blue."})  # string content
    out = tokenize_vl_conversation(proc, msgs, 1024, base_dir=Path(vl["data"]), sample="s")
    counts = [t * h * w // 4 for t, h, w in out["image_grid_thw"]]
    assert out["loss_mask"] == generation_mask(vl, tmp_path, msgs, counts)
    tok = proc.tokenizer
    picked = [t for t, m in zip(out["input_ids"], out["loss_mask"]) if m]
    assert tok.decode(picked) == (
        f"The box is red.{IM_END}Here: You are welcome.{IM_END}Blue.{IM_END}"
    )
    assert out["image_grid_thw"] == [[1, 4, 6], [1, 6, 4], [1, 4, 6]]
    # The same conversation with no system prompt (the template's other branch).
    out2 = tokenize_vl_conversation(proc, msgs[1:], 1024, base_dir=Path(vl["data"]), sample="s")
    assert tok.decode([t for t, m in zip(out2["input_ids"], out2["loss_mask"]) if m]) == tok.decode(
        picked
    )


def test_truncation_never_cuts_an_image(vl):
    from drafttrain.families.qwen3_vl.data import image_runs, tokenize_vl_conversation

    proc = processor(vl["target"])
    msgs = conversation("images/train_0003_0.png", "images/train_0003_1.png")
    full = tokenize_vl_conversation(proc, msgs, 1024, base_dir=Path(vl["data"]), sample="s")
    (a0, b0), (a1, b1) = image_runs(full["mm_token_type_ids"])
    for cut, want_len, want_grids in [
        (a1 + 2, a1, 1),  # inside the second image: back to its start, one image kept
        (b1, b1, 2),  # right after it: both kept
        (a0 + 1, a0, 0),  # inside the first
    ]:
        out = tokenize_vl_conversation(proc, msgs, cut, base_dir=Path(vl["data"]), sample="s")
        assert len(out["input_ids"]) == want_len and len(out["image_grid_thw"]) == want_grids
        assert out["input_ids"] == full["input_ids"][:want_len]


def test_split_lengths_count_vision_tokens_and_collate(vl):
    split = vl_split(vl)
    data = split.data
    assert set(data.column_names) >= {
        "input_ids",
        "loss_mask",
        "mm_token_type_ids",
        "image_grid_thw",
    }
    for row in data:
        assert row["length"] == len(row["input_ids"])
        n_img = sum(t * h * w // 4 for t, h, w in row["image_grid_thw"])
        assert sum(row["mm_token_type_ids"]) == n_img
    rows = [i for i in range(len(data)) if data[i]["image_grid_thw"]][:3] + [
        next(i for i in range(len(data)) if not data[i]["image_grid_thw"])
    ]
    batch = split.collate(rows, 0)
    grids = [g for i in rows for g in data[i]["image_grid_thw"]]
    assert batch["image_grid_thw"].tolist() == grids
    owners = [b for b, i in enumerate(rows) for _ in data[i]["image_grid_thw"]]
    assert batch["image_rows"].tolist() == owners
    assert batch["pixel_values"].shape == (sum(t * h * w for t, h, w in grids), PATCH_DIM)
    # Pixel rows are the processor's of each row's own conversation, in row order.
    proc = processor(vl["target"])
    src = vl_source(vl)
    at = 0
    for b, i in enumerate(rows):
        r = data[i]
        enc = conversation_inputs(
            proc,
            row_messages(src[r["source_row"]]),
            add_generation_prompt=False,
            base_dir=Path(vl["data"]),
            sample="s",
        )
        assert enc["input_ids"] == r["input_ids"]
        assert batch["input_ids"][b, : r["length"]].tolist() == r["input_ids"]
        assert batch["mm_token_type_ids"][b, : r["length"]].tolist() == r["mm_token_type_ids"]
        if enc["pixel_values"] is not None:
            n = enc["pixel_values"].shape[0]
            assert torch.equal(batch["pixel_values"][at : at + n], enc["pixel_values"])
            at += n


@functools.lru_cache(maxsize=1)
def _source(path: str):
    from draftinfer.evaluation.chat import load_chat_dataset

    return load_chat_dataset(path, "train")


def vl_source(vl):
    return _source(vl["data"])


def test_shard_batch_keeps_images_with_their_rows(vl):
    from drafttrain.trainer.distributed import shard_batch

    split = vl_split(vl)
    rows = list(range(5))
    batch = split.collate(rows, 0)
    for world in (2, 3):
        for rank in range(world):
            got = shard_batch(batch, rank, world, split)
            mine = rows[rank::world]
            ref = split.collate(mine, 0)
            T = ref["input_ids"].shape[1]
            assert torch.equal(got["input_ids"][:, :T], ref["input_ids"])
            assert torch.equal(got["mm_token_type_ids"][:, :T], ref["mm_token_type_ids"])
            assert ("pixel_values" in got) == ("pixel_values" in ref)
            if "pixel_values" in ref:
                for k in ("pixel_values", "image_grid_thw", "image_rows"):
                    assert torch.equal(got[k], ref[k]), k
    bad = {k: v for k, v in batch.items() if k != "image_rows"}
    with pytest.raises(ConfigError, match="image_rows"):
        shard_batch(bad, 0, 2, split)


def test_bad_images_are_one_line_errors_naming_the_sample(vl, tmp_path):
    from drafttrain.families.qwen3_vl.data import VLChatData

    data = write_vl_chat(tmp_path / "bad", n_train=6, n_test=1)
    (data / "images/train_0002_0.png").unlink()
    proc = processor(vl["target"])
    cfg = DataConfig(path=str(data), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError) as e:
        VLChatData(proc).tokenize(cfg)
    msg = str(e.value)
    assert "row 2" in msg and "train_0002_0.png" in msg and "not found" in msg
    assert "\n" not in msg
    (data / "images/train_0002_0.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    with pytest.raises(DataError) as e:
        VLChatData(proc).tokenize(cfg)
    assert "row 2" in str(e.value) and "cannot read image" in str(e.value)
    assert "\n" not in str(e.value)


def test_trl_parquet_with_image_features(vl, tmp_path):
    """Hub-style rows: a parquet file with an `images` column of `datasets` Image features
    and `{"type": "image", "index": k}` parts trains the same inputs as the path rows."""
    import datasets

    src = vl_source(vl)
    base = Path(vl["data"])
    rows = {"messages": [], "images": []}
    picked = [
        i
        for i in range(len(src))
        if any(p.get("type") == "image" for m in src[i]["messages"] for p in m["content"])
    ][:4]
    for i in picked:
        msgs, images = [], []
        for m in normalize_messages(src[i]["messages"]):
            parts = []
            for p in m["content"]:
                if p["type"] == "image":
                    parts.append({"type": "image", "index": len(images), "text": None})
                    images.append(str(base / p["image"]))
                else:
                    parts.append({"type": "text", "index": None, "text": p["text"]})
            msgs.append({"role": m["role"], "content": parts})
        rows["messages"].append(msgs)
        rows["images"].append(images)
    features = datasets.Features(
        {
            "messages": [
                {
                    "role": datasets.Value("string"),
                    "content": [
                        {
                            "type": datasets.Value("string"),
                            "index": datasets.Value("int64"),
                            "text": datasets.Value("string"),
                        }
                    ],
                }
            ],
            "images": datasets.Sequence(datasets.Image()),
        }
    )
    path = tmp_path / "trl.parquet"
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    from drafttrain.families.qwen3_vl.data import VLChatData

    split = VLChatData(processor(vl["target"])).tokenize(
        DataConfig(path=str(path), cache_dir=str(tmp_path / "c"))
    )
    ref = vl_split(vl)
    ref_rows = {ref.data[j]["source_row"]: j for j in range(len(ref.data))}
    got = split.collate(list(range(len(picked))), 0)
    want = ref.collate([ref_rows[i] for i in picked], 0)
    for k in ("input_ids", "loss_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(got[k], want[k]), k


# --------------------------------------------------------------------------- the target


def padded_batch(vl):
    """A collated batch of rows with 0, 1 and 2 images (right-padded)."""
    split = vl_split(vl)
    data = split.data
    by_images = {}
    for i in range(len(data)):
        by_images.setdefault(len(data[i]["image_grid_thw"]), i)
    rows = [by_images[0], by_images[1], by_images[2]]
    return split.collate(rows, 0), [data[i] for i in rows]


def hf_row(target, row) -> tuple:
    """HF's plain forward of one unpadded row (its own position computation):
    (logits, hidden_states, what each decoder layer received, deepstack `[n_ds, N_vis, H]`)."""
    model = target.model
    model.model.rope_deltas = None
    ids = torch.tensor([row["input_ids"]])
    kw = {"input_ids": ids, "mm_token_type_ids": torch.tensor([row["mm_token_type_ids"]])}
    ds = torch.zeros(N_DS, 0, H)
    if row["image_grid_thw"]:
        split_pixels = row["_pixels"]
        kw |= {"pixel_values": split_pixels, "image_grid_thw": torch.tensor(row["image_grid_thw"])}
        feats = model.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"])
        ds = torch.stack([torch.cat(level) for level in feats.deepstack_features])
    received = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, args, k: received.append(args[0] if args else k["hidden_states"]),
            with_kwargs=True,
        )
        for layer in model.model.language_model.layers
    ]
    try:
        with torch.no_grad():
            out = model(**kw, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0], out.hidden_states, received, ds


def expected_tap(hidden_states, deepstack, visual, j: int, with_deepstack: bool = True):
    ref = hidden_states[j][0].clone()
    if with_deepstack and 1 <= j <= len(deepstack):
        ref[visual] = ref[visual] + deepstack[j - 1]
    return ref


@pytest.fixture(scope="module")
def target_out(vl):
    target = frozen(vl["target"])
    batch, rows = padded_batch(vl)
    out = target.batch_output(batch, FeatureSpec(tuple(range(N_LAYERS)), "pre_norm"))
    # Each row's own pixel rows, for the per-row HF reference.
    at = 0
    for r in rows:
        n = sum(t * h * w for t, h, w in r["image_grid_thw"])
        r["_pixels"] = batch.get("pixel_values", torch.zeros(0, PATCH_DIM))[at : at + n]
        at += n
    return target, batch, rows, out


def test_s4_taps_logits_and_embeddings_equal_hf(target_out):
    """Tap j = HF `hidden_states[j]` + `deepstack[j-1]` at visual rows (1 <= j <= n_ds), equal
    elsewhere; = what each decoder layer receives; inputs_embeds = the embeddings after the
    vision scatter; logits = HF's plain forward; for a padded batch of 0/1/2-image rows."""
    target, batch, rows, out = target_out
    img = target.model.config.image_token_id
    for b, r in enumerate(rows):
        n = r["length"]
        logits, hs, received, ds = hf_row(target, r)
        visual = torch.tensor(r["input_ids"]) == img
        assert_close(target_logits(out)[b, :n], logits)
        assert_close(out.inputs_embeds[b, :n], hs[0][0])
        for j in range(N_LAYERS):
            tap = out.features[b, :n, j * H : (j + 1) * H]
            assert_close(tap, received[j][0])
            assert_close(tap, expected_tap(hs, ds, visual, j))
            if r["image_grid_thw"] and 1 <= j <= N_DS:
                assert (tap[visual] - hs[j][0][visual]).abs().max() > 1e-2  # a real add
                with pytest.raises(AssertionError):  # HF's hidden_states[j] as tap: caught
                    assert_close(tap, expected_tap(hs, ds, visual, j, with_deepstack=False))


def test_m1_rope_pos_is_transformers_get_rope_index(target_out):
    target, batch, rows, out = target_out
    assert out.rope_pos.shape == (3, *batch["input_ids"].shape)
    ref, _ = target.model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    assert torch.equal(out.rope_pos, ref)
    # Hand check of the [1, 4, 6] image (2 x 3 merged): T stays, H over 2 rows, W over 3, and
    # the text after it resumes at start + max(4, 6) // 2 = start + 3, not start + 6.
    img = target.model.config.image_token_id
    for b, r in enumerate(rows):
        if r["image_grid_thw"][:1] == [[1, 4, 6]]:
            s = r["input_ids"].index(img)
            p0 = int(out.rope_pos[0, b, s])
            assert out.rope_pos[:, b, s : s + 6].tolist() == [
                [p0] * 6,
                [p0, p0, p0, p0 + 1, p0 + 1, p0 + 1],
                [p0, p0 + 1, p0 + 2, p0, p0 + 1, p0 + 2],
            ]
            assert out.rope_pos[:, b, s + 6].tolist() == [p0 + 3] * 3  # <|vision_end|>
            break
    else:
        pytest.fail("no row opens with a [1, 4, 6] image")


def test_mm_mask_marks_image_slots(target_out):
    target, batch, rows, out = target_out
    img = target.model.config.image_token_id
    want = (batch["input_ids"] == img) & batch["attention_mask"].bool()
    assert torch.equal(out.mm_mask, want)
    text_only = {
        k: v for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw", "image_rows")
    }
    text_only = {k: v[:1] for k, v in text_only.items()}  # row 0 has no image
    assert target.batch_output(text_only, FeatureSpec((1,))).mm_mask is None


def test_target_info_and_drafter_rope(vl):
    from drafttrain.kinds.eagle3.config import Eagle3TrainConfig
    from drafttrain.kinds.eagle3.objective import drafter_config_from_target

    target = frozen(vl["target"])
    assert target.info.rope_axes == 3 and target.info.num_layers == N_LAYERS
    assert target.info.architecture == "Qwen3VLForConditionalGeneration"
    assert target.info.family == "qwen3_vl"
    assert target.layers is target.model.model.language_model.layers
    assert target.final_norm is target.model.model.language_model.norm
    arch = drafter_config_from_target(Eagle3TrainConfig(draft_vocab_size=64), target)
    assert arch.rope_scaling == {
        "rope_type": "default",
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    }
    assert arch.head_dim == 16 and arch.hidden_size == H


# --------------------------------------------------------------------------- drafters (S9)


class HandEmbedding(torch.nn.Module):
    """The drafter's token embedding with the vision embeddings put in by hand: row i of the
    first T rows consumes token i+1 (convention 1), so where token i+1 is an image
    placeholder it gets the target's input embedding of slot i+1 (convention 3)."""

    def __init__(self, base, ids, inputs_embeds, img: int, shift: int = 1):
        super().__init__()
        self.base, self.ids, self.embeds, self.img, self.shift = (
            base,
            ids,
            inputs_embeds,
            img,
            shift,
        )

    def forward(self, x):
        out = self.base(x).clone()
        T = self.ids.shape[1]
        for i in range(T - self.shift):
            if self.ids[0, i + self.shift] == self.img:
                out[0, i] = self.embeds[0, i + self.shift]
        return out


@pytest.mark.parametrize("kind", ["eagle3", "ptd"])
def test_s9_image_rows_use_the_shifted_vision_embedding(vl, target_out, kind):
    from draftinfer.conventions.window import TokenEmbeds
    from drafttrain.registry import InitContext, train_spec

    target, batch, rows, out = target_out
    spec = train_spec(kind)
    cfg = spec.config_class(kind=kind, draft_vocab_size=64, aux_layer_ids=[1, 2, 3])
    split = vl_split(vl)
    torch.manual_seed(0)
    tok = processor(vl["target"]).tokenizer
    drafter = spec.init_drafter(cfg, InitContext(target, tok, split.data, vl["root"] / "c"))
    for p in drafter.parameters():  # random weights everywhere the drafter owns
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.2)
    obj = spec.objective(drafter, cfg, "eager")
    b = 1  # the one-image row
    n = rows[b]["length"]
    ids = batch["input_ids"][b : b + 1, :n]
    img = target.model.config.image_token_id
    feats = target.batch_output(batch, drafter.config.features).features[b : b + 1, :n]
    pos = out.rope_pos[:, b : b + 1, :n]
    mm = TokenEmbeds(out.mm_mask[b : b + 1, :n], out.inputs_embeds[b : b + 1, :n])
    first = int((ids[0] == img).nonzero()[0]) - 1  # the row consuming the first image token
    anchors = [first - 1, first, first + 3]
    with torch.no_grad():
        got = {a: obj.anchor_logits(ids, feats, pos, a, 1, mm)[0] for a in anchors}
        dropped = {a: obj.anchor_logits(ids, feats, pos, a, 1, None)[0] for a in anchors}
        # 1-D positions (the token index on every axis, as text-only trainers use).
        flat_pos = torch.arange(n)[None, None].expand(3, 1, n)
        flat = {a: obj.anchor_logits(ids, feats, flat_pos, a, 1, mm)[0] for a in anchors}
        base = drafter.embed_tokens
        for shift, same in ((1, True), (0, False)):  # 0 = unshifted window (wrong convention)
            drafter.embed_tokens = HandEmbedding(
                base, ids, out.inputs_embeds[b : b + 1], img, shift
            )
            try:
                hand = {a: obj.anchor_logits(ids, feats, pos, a, 1, None)[0] for a in anchors}
            finally:
                drafter.embed_tokens = base
            for a in anchors[1:]:
                if same:
                    assert_close(got[a], hand[a])
                else:
                    assert not torch.allclose(got[a], hand[a], atol=1e-4)
    assert_close(got[first - 1], dropped[first - 1])  # before the image: text rows agree
    for a in anchors[1:]:  # rows consuming image tokens: the vision embedding is used
        assert not torch.allclose(got[a], dropped[a], atol=1e-4)
    # The target's 3-D positions are used: inside the image (H, W differ from the token index).
    assert not torch.allclose(got[first + 3], flat[first + 3], atol=1e-4)


# --------------------------------------------------------------------------- train, export


@pytest.fixture(scope="module")
def vl_run(vl, tmp_path_factory):
    """`vl_run(kind)` -> a short train + export job of `kind` on the tiny VL target."""
    from drafttrain.jobs.job import run_job
    from tests.support.presets import compose_preset

    runs: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"vl_{kind}")
            preset = f"qwen3_vl_{kind}"
            # Taps 1, 2, 3 (layer inputs) in each kind's own field.
            drafter = {
                "dflash": ["drafter.target_layer_ids=[0,1,2]", "drafter.block_size=4"],
            }.get(kind, ["drafter.draft_vocab_size=64", "drafter.aux_layer_ids=[1,2,3]"])
            overrides = [
                f"target.name_or_path={vl['target']}",
                f"data.path={vl['data']}",
                f"output_dir={out}",
                "trainer.max_steps=4",
                "trainer.progress=false",
                "trainer.save_every=0",
                "data.batch_size=4",
                "data.eval_batches=1",
                *drafter,
                "export.verify=false",
            ]
            runs[kind] = run_job(compose_preset(preset, overrides))
        return runs[kind]

    return get


@pytest.mark.parametrize("kind", ["eagle3", "ptd", "dflash"])
def test_export_carries_what_vllm_reads(vl_run, kind):
    summary = vl_run(kind)
    export = Path(summary["export_dir"])
    c = json.loads((export / "config.json").read_text())
    rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    eagle = kind != "dflash"
    assert c["architectures"] == (["LlamaForCausalLMEagle3"] if eagle else ["DFlashDraftModel"])
    assert c["rope_scaling"] == rope
    assert c["rope_parameters"] == {**rope, "rope_theta": 10000.0}
    assert c["target_model_type"] == "qwen3_vl"
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert c["max_position_embeddings"] == 512
    card = (export / "README.md").read_text()
    assert "pipeline_tag: image-text-to-text" in card and "mrope_interleaved: true" in card
    # vLLM's EAGLE-3 class note only for the architectures vLLM keeps as EAGLE-3.
    assert ("Eagle3LlamaForCausalLM" in card) == eagle
    if kind != "eagle3":  # parallel / block drafting: refused by vLLM, 1-D cost measurable
        assert "does not support M-RoPE yet" in card and "drafter_positions=1d" in card
        assert "positions[0]" in card
    if kind == "ptd":
        assert c["parallel_drafting"] is True
    if kind == "dflash":
        assert c["dflash_config"]["target_layer_ids"] == [0, 1, 2]
        assert "block slot s at the anchor's position + s on all three axes" in card
    # The runner reads the export back (rope strictly parsed, M-RoPE kept).
    from draftinfer.files.checkpoint import read_drafter_config

    _, arch, meta = read_drafter_config(export)
    assert arch.rope_scaling == rope and meta["drafter_kind"] == kind
    assert all(v == v for v in summary["losses"])  # finite


def test_feature_cache_refuses_vl_targets(vl, tmp_path):
    from drafttrain.cache.writer import write_cache
    from drafttrain.jobs.train import train
    from tests.support.presets import compose_preset

    base = [
        f"target.name_or_path={vl['target']}",
        f"data.path={vl['data']}",
        "trainer.progress=false",
    ]
    out = tmp_path / "run"
    cfg = compose_preset("qwen3_vl_eagle3", [*base, f"output_dir={out}", f"data.cache={tmp_path}"])
    with pytest.raises(ConfigError, match="feature cache does not support qwen3_vl") as e:
        train(cfg)
    assert "\n" not in str(e.value) and not out.exists()
    cfg = compose_preset(
        "qwen3_vl_eagle3", [*base, f"output_dir={out}", f"cache.dir={tmp_path / 'fc'}"]
    )
    with pytest.raises(ConfigError, match="feature cache does not support"):
        write_cache(cfg)
    assert not (tmp_path / "fc").exists()


def test_bad_image_fails_training_before_anything_is_written(vl, tmp_path):
    from drafttrain.jobs.train import train
    from tests.support.presets import compose_preset

    data = write_vl_chat(tmp_path / "bad", n_train=5, n_test=1)
    (data / "images/train_0001_0.png").unlink()
    out = tmp_path / "run"
    cfg = compose_preset(
        "qwen3_vl_eagle3",
        [
            f"target.name_or_path={vl['target']}",
            f"data.path={data}",
            f"output_dir={out}",
            f"data.cache_dir={tmp_path / 'c'}",
            "trainer.progress=false",
        ],
    )
    with pytest.raises(DataError, match="row 1.*not found"):
        train(cfg)
    assert not out.exists()


def test_presets_point_at_the_zoo_and_the_hub():
    from tests.support.presets import compose_preset

    for name, kind in (
        ("qwen3_vl_eagle3", "eagle3"),
        ("qwen3_vl_ptd", "ptd"),
        ("qwen3_vl_dflash", "dflash"),
        ("qwen3_vl_dspark", "dflash"),
    ):
        cfg = compose_preset(name)
        assert cfg.drafter.kind == kind and cfg.target.name_or_path == "zoo:qwen3-vl-tiny"
        assert cfg.data.path == "zoo:vl_caption" and cfg.data.eval_split == "test"
    dspark = compose_preset("qwen3_vl_dspark").drafter
    assert dspark.dspark and (dspark.block_size, dspark.markov_rank) == (7, 256)
    big = compose_preset("qwen3_vl_eagle3_8b")
    assert big.target.name_or_path == "Qwen/Qwen3-VL-8B-Instruct"
    assert big.data.path == "HuggingFaceH4/llava-instruct-mix-vsft"
    assert big.drafter.draft_vocab_size == 32000 and big.trainer.max_steps >= 10000
