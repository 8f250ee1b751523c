"""A tiny random Qwen3-VL target with a real processor layout, and image+text chat data, for
the training-side Qwen3-VL tests (tests/test_qwen3_vl_train.py).

`make_vl_target(dir)` writes what a Qwen3-VL checkpoint ships, at toy scale and loaded back
through transformers: a byte-level BPE tokenizer with Qwen3-VL's special tokens,
`chat_template.jinja` (`QWEN3_VL_TEMPLATE`, which renders like the released Qwen3-VL Instruct
template: no `{% generation %}` markers), `preprocessor_config.json` (Qwen2-VL image
processor, patch 4, merge 2) and a random `Qwen3VLForConditionalGeneration` of the shared
tiny architecture (`tests/vl_fixtures.py`: DESIGN 5, vision `out_hidden_size` = text hidden 64,
3 DeepStack levels, interleaved `mrope_section [4, 2, 2]` at head_dim 16, 5 text layers) with
this tokenizer's vocabulary and special ids.

`write_vl_chat(dir, ...)` writes `{train,test}.jsonl` + `images/*.png` in the `messages` format
(content lists of `{"type": "image", "image": "images/x.png"}` / `{"type": "text", ...}`), rows
with 0, 1 and 2 images of sizes 16x24 / 24x16 / 16x16 px: grids [1, 4, 6] / [1, 6, 4] /
[1, 4, 4] (6 / 6 / 4 image tokens; for [1, 4, 6] `max(h, w) // merge` = 3 differs from 6).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tests.support.tiny_tokenizers import _save_and_load, _train_bpe
from tests.support.vl_fixtures import N_DS, N_LAYERS, PATCH_DIM, H  # noqa: F401  (re-exported)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
SPECIALS = [ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
PATCH, MERGE, TEMPORAL = 4, 2, 2  # the image processor's, as the tower's config says

# Renders as the released Qwen3-VL Instruct chat template does (its tool branches left out):
# an optional first system message, then per message `<|im_start|>{role}\n...<|im_end|>\n`;
# image parts are `<|vision_start|><|image_pad|><|vision_end|>` (the processor expands the
# pad), selected by `type == 'image'` or an `image` / `image_url` key; text parts print their
# text; the generation prompt is `<|im_start|>assistant\n`. Like the real one, it has no
# `{% generation %}` markers, so assistant masks must come from spans.
QWEN3_VL_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}"
    "{%- if 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content_item in message.content %}"
    "{%- if 'text' in content_item %}{{- content_item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def vl_config(tok):
    """`tests.support.vl_fixtures.tiny_vl_config()` (the shared tiny architecture) with this
    tokenizer's vocabulary and special token ids."""
    from tests.support.vl_fixtures import tiny_vl_config

    ids = tok.convert_tokens_to_ids
    cfg = tiny_vl_config()
    cfg.text_config.vocab_size = 512
    cfg.text_config.pad_token_id = ids(ENDOFTEXT)
    cfg.text_config.eos_token_id = ids(IM_END)
    cfg.image_token_id, cfg.video_token_id = ids(IMAGE_PAD), ids(VIDEO_PAD)
    cfg.vision_start_token_id, cfg.vision_end_token_id = ids(VISION_START), ids(VISION_END)
    cfg.eos_token_id = ids(IM_END)
    cfg.tie_word_embeddings = False
    return cfg


def write_processor_files(out: Path, template: str = QWEN3_VL_TEMPLATE):
    """Tokenizer, `chat_template.jinja` and `preprocessor_config.json` into `out`; returns the
    tokenizer loaded back."""
    out.mkdir(parents=True, exist_ok=True)
    tok = _save_and_load(_train_bpe(SPECIALS), out, None, eos_token=IM_END, pad_token=ENDOFTEXT)
    (out / "chat_template.jinja").write_text(template)
    image = {
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 8 * 8, "longest_edge": 48 * 48},
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
    }
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    return tok


def make_vl_target(out: Path, seed: int = 0) -> Path:
    """A complete tiny Qwen3-VL checkpoint directory (module docstring)."""
    from transformers import Qwen3VLForConditionalGeneration

    tok = write_processor_files(out)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(vl_config(tok))
    model.save_pretrained(str(out))
    return out


# --------------------------------------------------------------------------- data

COLOURS = {"red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 215)}
SIZES = ((16, 24), (24, 16), (16, 16))  # (height, width)


def draw(path: Path, colour: str, size: tuple[int, int], seed: int) -> None:
    from PIL import Image, ImageDraw

    h, w = size
    img = Image.new("RGB", (w, h), (255, 255, 255))
    rng = random.Random(seed)
    x, y = rng.randint(0, w - 8), rng.randint(0, h - 8)
    ImageDraw.Draw(img).rectangle([x, y, x + 7, y + 7], fill=COLOURS[colour])
    img.save(path)


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(p: str) -> dict:
    return {"type": "image", "image": p}


def vl_rows(root: Path, split: str, n: int, seed: int = 0) -> list[dict]:
    """`n` rows (images drawn under `root/images`): 1-image rows, every 4th with 2 images,
    every 5th text-only, every 3rd with a system prompt and a second text turn."""
    rng = random.Random(f"{split}/{seed}")
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        n_img = 0 if i % 5 == 4 else (2 if i % 4 == 3 else 1)
        colours, parts = [], []
        for k in range(n_img):
            c = rng.choice(sorted(COLOURS))
            rel = f"images/{split}_{i:04d}_{k}.png"
            draw(root / rel, c, SIZES[(i + k) % len(SIZES)], seed=i * 7 + k)
            colours.append(c)
            parts.append(image(rel))
        if n_img:
            question, answer = "What colour is the box?", f"The box is {' and '.join(colours)}."
        else:
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            question, answer = f"What is {a} plus {b}?", f"The result is {a + b}."
        msgs = [
            {"role": "user", "content": [*parts, text(question)]},
            {"role": "assistant", "content": [text(answer)]},
        ]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": [text("You are a helpful model.")]})
            msgs += [
                {"role": "user", "content": [text("Thanks!")]},
                {"role": "assistant", "content": [text("You are welcome.")]},
            ]
        rows.append({"messages": msgs})
    return rows


def write_vl_chat(root: Path, n_train: int = 24, n_test: int = 8) -> Path:
    """`root/{train,test}.jsonl` + `root/images/` (module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        with open(root / f"{split}.jsonl", "w") as f:
            for row in vl_rows(root, split, n):
                f.write(json.dumps(row) + "\n")
    return root
