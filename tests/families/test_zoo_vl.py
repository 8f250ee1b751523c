"""The zoo's tiny Qwen3-VL target (`draftinfer/zoo/qwen3-vl-tiny`) and its data
(`draftinfer/zoo/vl_caption`), built by `python -m drafttrain.zoo.build_vl`, load through the
public entry points and are trained.

Checks: the config meets DESIGN 5's Qwen3-VL constraints; the chat template renders Qwen3-VL's
layout; a held-out row goes through the processor encoding (one `<|image_pad|>` per 2x2
merged patches, grids of the real image sizes, images from local paths) and its assistant
mask covers exactly each answer and its `<|im_end|>`, token by token; the data regenerates
byte for byte and its split holds out whole scenes; the model answers held-out questions
(a random-init model would not); a two-step build runs end to end.

Without torchvision, transformers 5 cannot build a `Qwen3VLProcessor` (its video processor
needs it), so the processor encoding is `vl_data.encode_chat` (tokenizer + image
processor); where torchvision is installed, `AutoProcessor` is checked against it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from draftinfer.files.paths import ZOO_DIR as ZOO
from drafttrain.zoo import vl_data as vd

MODEL = ZOO / "qwen3-vl-tiny"
DATA = ZOO / "vl_caption"

SPECIALS = vd.SPECIAL_TOKENS


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def image_processor():
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3VLForConditionalGeneration

    m, info = Qwen3VLForConditionalGeneration.from_pretrained(
        MODEL, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    return m.eval()


@pytest.fixture(scope="module")
def test_rows():
    return vd.load_rows(DATA / "test.jsonl")


def _n_images(row: dict) -> int:
    return len(vd.chat_images(row["messages"]))


def test_config_meets_design5(model, tok):
    cfg = model.config
    t, v = cfg.text_config, cfg.vision_config
    assert cfg.model_type == "qwen3_vl"
    assert cfg.architectures == ["Qwen3VLForConditionalGeneration"]
    assert v.out_hidden_size == t.hidden_size
    ds = list(v.deepstack_visual_indexes)
    assert len(ds) == 3 and ds == sorted(set(ds)) and max(ds) < v.depth
    assert len(ds) <= t.num_hidden_layers
    side = math.isqrt(v.num_position_embeddings)
    assert side * side == v.num_position_embeddings
    assert side >= 96 // v.patch_size  # the largest image side, in patches
    rope = t.rope_parameters
    assert sum(rope["mrope_section"]) == t.head_dim // 2 and min(rope["mrope_section"]) > 0
    assert rope["mrope_interleaved"] is True
    assert v.spatial_merge_size == 2
    ids = tok.convert_tokens_to_ids
    assert (
        cfg.image_token_id,
        cfg.video_token_id,
        cfg.vision_start_token_id,
        cfg.vision_end_token_id,
    ) == tuple(
        ids(s) for s in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    raw = json.loads((MODEL / "config.json").read_text())
    assert raw["tie_word_embeddings"] is True  # the top-level flag is the one HF ties by
    lm = model.model.language_model
    assert model.lm_head.weight.data_ptr() == lm.embed_tokens.weight.data_ptr()
    L = t.num_hidden_layers
    assert len({2, L // 2, L - 3}) == 3  # default aux taps are distinct
    assert len(tok) <= t.vocab_size < len(tok) + 128  # padded like Qwen's embedding
    gen = json.loads((MODEL / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids("<|im_end|>"), ids("<|endoftext|>")]
    assert gen["do_sample"] is False


def test_weights_are_small_bf16_safetensors():
    from safetensors import safe_open

    path = MODEL / "model.safetensors"
    assert path.stat().st_size <= 6 * 2**20
    with safe_open(path, "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "lm_head.weight" not in f.keys()  # tied
        assert any(k.startswith("model.visual.deepstack_merger_list.2.") for k in f.keys())


def test_tokenizer_and_chat_template(tok, test_rows):
    from tokenizers import Tokenizer

    assert all(tok.convert_tokens_to_ids(s) != tok.unk_token_id for s in SPECIALS)
    assert tok.convert_tokens_to_ids(SPECIALS) == list(range(len(tok) - 7, len(tok)))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    raw = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    text = "A red circle at the top left and 12 purple crosses? zebra"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == raw.encode(text, add_special_tokens=False).ids and tok.decode(ids) == text
    assert tok(text)["input_ids"] == ids  # no bos, like Qwen
    assert (MODEL / "chat_template.jinja").read_text() == vd.CHAT_TEMPLATE
    msgs = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Hi?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi?<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    assert tok.apply_chat_template(msgs, tokenize=False) == expected
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == expected[: expected.index("Hello.")]
    for r in test_rows[:50]:
        assert tok.apply_chat_template(r["messages"], tokenize=False) == vd.render_chat(
            r["messages"]
        )


def _pick(rows: list[dict], pred) -> dict:
    return next(r for r in rows if pred(r))


def test_held_out_row_through_processor(tok, image_processor, test_rows):
    from PIL import Image

    row = _pick(test_rows, lambda r: _n_images(r) == 2)
    msgs = row["messages"]
    paths = vd.chat_images(msgs)
    assert all(Path(p).is_absolute() and Path(p).is_file() for p in paths)
    enc = vd.encode_chat(tok, image_processor, msgs)
    assert {"input_ids", "attention_mask", "mm_token_type_ids", "assistant_masks"} <= set(enc)
    ids = enc["input_ids"][0].tolist()
    img_id = tok.convert_tokens_to_ids("<|image_pad|>")
    start = tok.convert_tokens_to_ids("<|vision_start|>")
    grids = enc["image_grid_thw"].tolist()
    for k, p in enumerate(paths):
        w, h = Image.open(p).size
        assert grids[k] == [1, h // 8, w // 8]  # the image keeps its size (patch 8)
    # The k-th vision block holds t*h*w / merge**2 image tokens.
    starts = [i for i, t in enumerate(ids) if t == start]
    assert len(starts) == 2
    for (t, h, w), s in zip(grids, starts):
        n = t * h * w // 4
        assert ids[s + 1 : s + 1 + n] == [img_id] * n
        assert ids[s + 1 + n] == tok.convert_tokens_to_ids("<|vision_end|>")
    assert enc["pixel_values"].shape == (sum(t * h * w for t, h, w in grids), 3 * 2 * 8 * 8)
    assert enc["mm_token_type_ids"][0].tolist() == [int(t == img_id) for t in ids]
    # PIL images give what paths give.
    pil = [
        {
            **m,
            "content": [
                {**p, "image": Image.open(p["image"])} if p["type"] == "image" else p
                for p in m["content"]
            ],
        }
        for m in msgs
    ]
    enc2 = vd.encode_chat(tok, image_processor, pil)
    assert torch.equal(enc2["pixel_values"], enc["pixel_values"])
    assert torch.equal(enc2["input_ids"], enc["input_ids"])
    # All three sizes occur; on each, max(h, w) // merge differs from the token count.
    sizes = {Image.open(p).size for r in test_rows[:40] for p in vd.chat_images(r["messages"])}
    assert sizes == {(48, 48), (96, 48), (48, 96)}
    for w, h in sizes:
        gh, gw = h // 8, w // 8
        assert max(gh, gw) // 2 != gh * gw // 4


def _expected_encoding(tok, messages: list[dict], grids: list[list[int]]):
    """Ids and assistant mask built message by message, independently of the template's
    `{% generation %}` tracking: every message starts and ends with a special token, so
    the chat tokenizes as the concatenation of its messages; in an assistant message the
    header `<|im_start|>assistant\\n` and the trailing `\\n` are 0, content + `<|im_end|>` 1."""

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    ids, mask = [], []
    for m in messages:
        if m["role"] == "assistant":
            head, body, tail = (
                enc("<|im_start|>assistant\n"),
                enc(vd.render_chat([m])[len("<|im_start|>assistant\n") : -1]),
                enc("\n"),
            )
            assert head + body + tail == enc(vd.render_chat([m]))
            ids += head + body + tail
            mask += [0] * len(head) + [1] * len(body) + [0] * len(tail)
        else:
            part = enc(vd.render_chat([m]))
            ids += part
            mask += [0] * len(part)
    img_id = tok.convert_tokens_to_ids("<|image_pad|>")
    out_ids, out_mask, k = [], [], 0
    for t, b in zip(ids, mask):
        n = grids[k][0] * grids[k][1] * grids[k][2] // 4 if t == img_id else 1
        k += t == img_id
        out_ids += [t] * n
        out_mask += [b] * n
    return out_ids, out_mask


def test_assistant_mask_is_exactly_the_answers(tok, image_processor, test_rows):
    # A row with a system prompt, an image and two assistant turns, and a two-image row.
    multi = _pick(
        test_rows,
        lambda r: (
            r["messages"][0]["role"] == "system"
            and sum(m["role"] == "assistant" for m in r["messages"]) == 2
        ),
    )
    pair = _pick(test_rows, lambda r: _n_images(r) == 2)
    for row in (multi, pair):
        msgs = row["messages"]
        enc = vd.encode_chat(tok, image_processor, msgs)
        grids = enc["image_grid_thw"].tolist()
        ids, mask = _expected_encoding(tok, msgs, grids)
        got_ids = enc["input_ids"][0].tolist()
        got_mask = enc["assistant_masks"][0].tolist()
        assert len(got_ids) == len(ids)
        for i, (a, b, c, d) in enumerate(zip(got_ids, ids, got_mask, mask)):
            assert (a, c) == (b, d), (i, tok.decode(got_ids[max(0, i - 3) : i + 3]))
        answers = [vd_text(m) + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
        assert tok.decode([t for t, b in zip(got_ids, got_mask) if b]) == "".join(answers)
    # The generation prompt is context, not a target.
    enc = vd.encode_chat(tok, image_processor, multi["messages"][:-1], add_generation_prompt=True)
    assert tok.decode(enc["input_ids"][0, -3:]) == "<|im_start|>assistant\n"


def vd_text(m: dict) -> str:
    return "".join(p["text"] for p in m["content"] if p["type"] == "text")


def _transformers_processor():
    """transformers' own `Qwen3VLProcessor` from the shipped files: `AutoProcessor` where
    torchvision imports (transformers 5 builds the video processor with it), else the same
    class without its video processor (`load_processor`'s fallback). torchvision cannot be had
    beside the CPU torch build CI installs (PyPI's torchvision 0.28.0 fails to import with
    torch 2.13.0+cpu: `operator torchvision::nms does not exist`), so the test runs on the
    image path either way instead of skipping."""
    from transformers import AutoProcessor

    from draftinfer.families.qwen3_vl.processor import load_processor

    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError from a mismatched build
        return load_processor(str(MODEL))
    return AutoProcessor.from_pretrained(MODEL)


def test_auto_processor_matches_encode_chat(tok, image_processor, test_rows):
    """transformers' own `Qwen3VLProcessor` built from the shipped files gives what
    `encode_chat` gives."""
    import transformers
    from packaging.version import Version
    from transformers import Qwen3VLProcessor

    proc = _transformers_processor()
    assert isinstance(proc, Qwen3VLProcessor)
    for row in (test_rows[0], _pick(test_rows, lambda r: _n_images(r) == 2)):
        got = proc.apply_chat_template(
            row["messages"],
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            return_assistant_tokens_mask=True,
        )
        ref = vd.encode_chat(tok, image_processor, row["messages"])
        keys = ["input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"]
        # transformers < 5.23 returns all-zero `assistant_masks` once images are expanded
        # (measured on 5.17: ids equal, masks empty); encode_chat's mask is right on both.
        if Version(transformers.__version__) >= Version("5.23"):
            keys.append("assistant_masks")
        for k in keys:
            a, b = torch.as_tensor(got[k]).tolist(), ref[k].tolist()
            assert a == b, (k, a, b)
        torch.testing.assert_close(got["pixel_values"], ref["pixel_values"], atol=1e-5, rtol=0)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_data_regenerates_and_holds_out_scenes(tmp_path):
    args = json.loads((ZOO / "build_log_vl.json").read_text())["args"]
    n_train, n_test, seed = int(args["train_images"]), int(args["test_images"]), int(args["seed"])
    splits = vd.build(tmp_path, n_train, n_test, seed)
    for name in ("train.jsonl", "test.jsonl"):
        assert _sha(tmp_path / name) == _sha(DATA / name), name
    shipped = sorted(p.name for p in (DATA / "images").glob("*.png"))
    assert shipped == sorted(p.name for p in (tmp_path / "images").glob("*.png"))
    assert len(shipped) == n_train + n_test
    for name in shipped[:: max(1, len(shipped) // 50)]:
        assert _sha(tmp_path / "images" / name) == _sha(DATA / "images" / name), name
    train_scenes = {s.key() for s in splits["train"][2]}
    assert not train_scenes & {s.key() for s in splits["test"][2]}
    # Answers are a function of (images, question): never two answers to one question.
    answers = defaultdict(set)
    for r in splits["train"][0]:
        msgs = [m for m in r["messages"] if m["role"] != "system"]
        imgs = tuple(vd.chat_images(msgs[:1]))
        for q, a in zip(msgs[::2], msgs[1::2]):
            answers[(imgs, vd_text(q))].add(vd_text(a))
    assert max(len(v) for v in answers.values()) == 1
    kinds = set(splits["train"][1])
    assert {"describe", "count", "where", "yes_no", "more", "describe_both", "text"} <= kinds
    size = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert size <= 3 * 2**20


@torch.no_grad()
def test_model_is_trained(model, tok, image_processor, test_rows):
    """Teacher-forced greedy accuracy on held-out answer tokens is far above chance (shipped
    model: 0.785 on the whole test split; random init ~1/640), and greedy generation closes
    its answers with `<|im_end|>`. The answers' templates are learned; their visual content
    mostly is not (draftinfer/zoo/README.md gives the exact-match per question kind)."""
    correct = total = ended = 0
    rows = test_rows[:16]
    for r in rows:
        enc = vd.encode_chat(tok, image_processor, r["messages"])
        mask = enc.pop("assistant_masks")[0]  # [T]
        logits = model(**enc).logits[0]  # [T, V]
        pred, ids = logits[:-1].argmax(-1), enc["input_ids"][0, 1:]  # predicts token t + 1
        keep = mask[1:].bool()
        correct += (pred[keep] == ids[keep]).sum().item()
        total += keep.sum().item()
    for r in rows[:6]:
        enc = vd.encode_chat(tok, image_processor, r["messages"][:-1], add_generation_prompt=True)
        enc.pop("assistant_masks")
        out = model.generate(**enc, max_new_tokens=48, do_sample=False)
        ended += out[0, -1].item() == tok.eos_token_id
    assert correct / total > 0.7, correct / total
    assert ended >= 5, ended


def test_two_step_build(tmp_path):
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from drafttrain.zoo import build_vl

    threads = torch.get_num_threads()
    report = build_vl.main(
        ["--out", str(tmp_path), "--steps", "2", "--train-images", "30", "--test-images", "6"]
        + ["--gen-rows", "2", "--eval-train-rows", "8", "--no-progress"]
    )
    assert torch.get_num_threads() == threads  # restored
    assert [e["step"] for e in report["log"]] == [2]
    assert math.isfinite(report["metrics"]["test"]["loss"])
    mdir = tmp_path / "qwen3-vl-tiny"
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    ):
        assert (mdir / name).is_file(), name
    assert (tmp_path / "vl_caption" / "test.jsonl").is_file()
    assert json.loads((tmp_path / "build_log_vl.json").read_text())["rows"] == report["rows"]
    AutoTokenizer.from_pretrained(mdir)
    _, info = Qwen3VLForConditionalGeneration.from_pretrained(mdir, output_loading_info=True)
    assert not any(info.values())
