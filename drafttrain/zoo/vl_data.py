"""Synthetic image-caption chat for the zoo's tiny Qwen3-VL target, rendered offline with PIL.

    python -m drafttrain.zoo.vl_data --out draftinfer/zoo/vl_caption   # what build_vl writes
    python -m drafttrain.zoo.vl_data --out /tmp/vl --train-images 50 --test-images 10

Every answer is a function of the image(s) and the question kind alone (never of the phrasing
or of chance), so a trained target is predictable and a drafter of it gets real acceptance.

Vocabulary used below:
- *scene*: an image size `(height, width)` and 1-3 *objects* `(shape, colour, cell)` on a plain
  background, at most one object per cell of a 3 x 3 grid. Rendering adds jitter (position
  inside the cell, object size), so two images of one scene differ in pixels, not in answers.
- *cell*: `(row, col)` in 0..2; its phrase names it in every question and answer
  ("at the top left", "in the center", "on the right", ...). Reading order = row-major.
- *row*: one conversation `{"messages": [...]}` in the multimodal `messages` format: every
  `content` is a list of parts `{"type": "image", "image": "images/train_000123.png"}` or
  `{"type": "text", "text": ...}` (lists everywhere, so `datasets` infers one schema). Image
  paths are relative to the folder of the jsonl file (`resolve_images` makes them absolute).
- *kind*: the question family of the row's last user turn (`describe`, `count`, ...; `text`
  for text-only rows); the build reports held-out exact-match of last answers per kind.

Sizes 48x48, 48x96 and 96x48 (h x w): with patch 8 and merge 2 the grids are [1, 6, 6],
[1, 6, 12] and [1, 12, 6], i.e. 9 or 18 vision tokens of 16 x 16 pixels, and `max(h, w) //
merge` (3 or 6) differs from the token count, as DESIGN 5 wants. Each object is drawn inside
one such tile, so one vision token sees a whole object (`render`).
**Split:** the test images are drawn from their own seed stream and a test scene whose
objects and size equal a train scene's is redrawn, so held-out images are new scenes, not
only new pixels. Deterministic for a given seed (PIL drawing and PNG encoding are exact).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from drafttrain.zoo.text_data import read_jsonl, write_jsonl

SHAPES = ("circle", "square", "triangle", "star", "cross", "diamond")
PLURAL = {s: s + ("es" if s.endswith("ss") else "s") for s in SHAPES}
COLOURS = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 215),
    "yellow": (235, 200, 30),
    "purple": (135, 55, 175),
    "orange": (245, 130, 30),
}
BACKGROUNDS = ((255, 255, 255), (232, 232, 232), (245, 238, 220))  # white, light grey, cream
SIZES = ((48, 48), (48, 96), (96, 48))  # (height, width): 3 x 3 cells of 1 or 2 tiles
CELL_PHRASE = {
    (0, 0): "at the top left",
    (0, 1): "at the top",
    (0, 2): "at the top right",
    (1, 0): "on the left",
    (1, 1): "in the center",
    (1, 2): "on the right",
    (2, 0): "at the bottom left",
    (2, 1): "at the bottom",
    (2, 2): "at the bottom right",
}
NUMBER = ("no", "one", "two", "three")
ORDINAL = ("first", "second")
CORNERS = {"triangle": 3, "square": 4, "diamond": 4, "star": 10, "cross": 12, "circle": 0}
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
SYSTEM_PROMPT = "You are a helpful assistant that answers questions about simple pictures."


@dataclass(frozen=True, order=True)
class Obj:
    cell: tuple[int, int]  # first field: sorting objects gives reading order
    shape: str
    colour: str

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"


@dataclass(frozen=True)
class Scene:
    size: tuple[int, int]  # (height, width) in pixels
    objs: tuple[Obj, ...]  # reading order

    def key(self) -> tuple:
        return (self.size, self.objs)


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def a_name(o: Obj) -> str:
    return f"{article(o.colour)} {o.name}"


def count_phrase(n: int, noun: str, plural: str) -> str:
    """'There is one circle.' / 'There are no circles.' (sentence without the final dot)."""
    return f"There is one {noun}" if n == 1 else f"There are {NUMBER[n]} {plural}"


def listing(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


# ---------------------------------------------------------------------------------------
# Scenes and rendering
# ---------------------------------------------------------------------------------------


def sample_scene(rng: random.Random) -> Scene:
    n = rng.choices((1, 2, 3), weights=(3, 3.5, 3.5))[0]
    cells = rng.sample(sorted(CELL_PHRASE), n)
    objs = tuple(sorted(Obj(c, rng.choice(SHAPES), rng.choice(list(COLOURS))) for c in cells))
    return Scene(rng.choice(SIZES), objs)


def _shape_points(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r * 0.8, cy), (cx, cy + r), (cx - r * 0.8, cy)]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            ang = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + rad * math.cos(ang), cy + rad * math.sin(ang)))
        return pts
    raise ValueError(shape)


TILE = 16  # pixels per merged vision token (patch 8 x merge 2)


def render(scene: Scene, rng: random.Random):
    """A palette PNG-ready PIL image of `scene`; `rng` draws background, sizes and jitter.

    Each object is drawn inside one 16 x 16 tile, i.e. inside the pixels of one merged
    vision token (patch 8, merge 2): a cell of the 3 x 3 grid spans 1 x 1 tiles (48 px side)
    or 2 tiles (96 px side), and the object sits in one of them, jittered within it.
    """
    from PIL import Image, ImageDraw

    h, w = scene.size
    bg = rng.choice(BACKGROUNDS)
    palette = [*bg, *(c for rgb in COLOURS.values() for c in rgb)]
    img = Image.new("P", (w, h), 0)
    img.putpalette(palette)  # 7 entries: a short PLTE chunk, ~200-byte files
    draw = ImageDraw.Draw(img)
    tiles_y, tiles_x = h // TILE // 3, w // TILE // 3  # tiles per cell along each axis
    for o in scene.objs:
        col = 1 + list(COLOURS).index(o.colour)
        ty = o.cell[0] * tiles_y + rng.randrange(tiles_y)
        tx = o.cell[1] * tiles_x + rng.randrange(tiles_x)
        r = rng.uniform(5.0, 6.5)
        slack = max(0.0, TILE / 2 - r - 0.5)
        cx = (tx + 0.5) * TILE + rng.uniform(-slack, slack)
        cy = (ty + 0.5) * TILE + rng.uniform(-slack, slack)
        box = [cx - r, cy - r, cx + r, cy + r]
        if o.shape == "circle":
            draw.ellipse(box, fill=col)
        elif o.shape == "square":
            q = r * 0.85
            draw.rectangle([cx - q, cy - q, cx + q, cy + q], fill=col)
        elif o.shape == "cross":
            t = r * 0.35
            draw.rectangle([cx - r, cy - t, cx + r, cy + t], fill=col)
            draw.rectangle([cx - t, cy - r, cx + t, cy + r], fill=col)
        else:
            draw.polygon(_shape_points(o.shape, cx, cy, r), fill=col)
    return img


# ---------------------------------------------------------------------------------------
# Questions and answers (one function per kind; answers depend on the scene only)
# ---------------------------------------------------------------------------------------

PHRASINGS = {
    "describe": (
        "Describe the image.",
        "What is in this picture?",
        "Describe what you see.",
        "What does the image show?",
    ),
    "count": (
        "How many shapes are there?",
        "How many shapes are in the image?",
        "Count the shapes.",
    ),
    "count_shape": ("How many {plural} are there?", "How many {plural} do you see?"),
    "count_colour": ("How many {colour} shapes are there?",),
    "colour_of": ("What colour is the {shape}?", "Which colour does the {shape} have?"),
    "where": ("Where is the {name}?", "Where is the {name} in the image?"),
    "what_at": ("What is {phrase}?", "Which shape is {phrase}?"),
    "yes_no": ("Is there {a_name} in the image?", "Do you see {a_name}?"),
}


def describe(scene: Scene) -> str:
    parts = [f"{a_name(o)} {CELL_PHRASE[o.cell]}" for o in scene.objs]
    s = listing(parts)
    return s[0].upper() + s[1:] + "."


def qa_single(scene: Scene, kind: str, rng: random.Random) -> tuple[str, str] | None:
    """(question, answer) of `kind` about `scene`, or None where the kind does not apply
    (e.g. "What colour is the star?" needs exactly one star)."""
    objs = scene.objs
    shapes = Counter(o.shape for o in objs)
    ph = rng.choice(PHRASINGS[kind])
    if kind == "describe":
        return ph, describe(scene)
    if kind == "count":
        return ph, count_phrase(len(objs), "shape", "shapes") + "."
    if kind == "count_shape":
        s = rng.choice(sorted(shapes)) if rng.random() < 0.6 else rng.choice(SHAPES)
        return ph.format(plural=PLURAL[s]), count_phrase(shapes[s], s, PLURAL[s]) + "."
    if kind == "count_colour":
        present = sorted({o.colour for o in objs})
        c = rng.choice(present) if rng.random() < 0.6 else rng.choice(list(COLOURS))
        n = sum(o.colour == c for o in objs)
        return ph.format(colour=c), count_phrase(n, f"{c} shape", f"{c} shapes") + "."
    if kind == "colour_of":
        unique = [o for o in objs if shapes[o.shape] == 1]
        if not unique:
            return None
        o = rng.choice(unique)
        return ph.format(shape=o.shape), f"The {o.shape} is {o.colour}."
    if kind == "where":
        o = rng.choice(objs)  # cells are distinct, but (colour, shape) may repeat
        if sum(p.name == o.name for p in objs) > 1:
            return None
        return ph.format(name=o.name), f"The {o.name} is {CELL_PHRASE[o.cell]}."
    if kind == "what_at":
        occupied = {o.cell: o for o in objs}
        if rng.random() < 0.7:
            cell = rng.choice(sorted(occupied))
        else:
            cell = rng.choice(sorted(CELL_PHRASE))
        phrase = CELL_PHRASE[cell]
        o = occupied.get(cell)
        answer = f"There is {a_name(o)} {phrase}." if o else f"There is nothing {phrase}."
        return ph.format(phrase=phrase), answer
    if kind == "yes_no":
        if rng.random() < 0.5:
            o = rng.choice(objs)
            q = ph.format(a_name=a_name(o))
            return q, f"Yes, there is {a_name(o)} {CELL_PHRASE[o.cell]}."
        names = {o.name for o in objs}
        # A near miss half the time: a shape that is there, in a colour it is not.
        for _ in range(50):
            s = rng.choice(sorted(shapes)) if rng.random() < 0.5 else rng.choice(SHAPES)
            c = rng.choice(list(COLOURS))
            if f"{c} {s}" not in names:
                break
        o = Obj((0, 0), s, c)
        return ph.format(a_name=a_name(o)), f"No, there is no {o.name}."
    raise ValueError(kind)


SINGLE_KINDS = {
    "describe": 0.28,
    "count": 0.08,
    "count_shape": 0.1,
    "count_colour": 0.07,
    "colour_of": 0.1,
    "where": 0.12,
    "what_at": 0.1,
    "yes_no": 0.15,
}
PAIR_KINDS = ("more", "which_has", "same_count", "describe_both")


def qa_pair(a: Scene, b: Scene, kind: str, rng: random.Random) -> tuple[str, str] | None:
    """(question, answer) about two images (first = a, second = b), or None if n/a."""
    na, nb = len(a.objs), len(b.objs)
    if kind == "more":
        if na == nb:
            return None
        q = rng.choice(("Which image has more shapes?", "Which of the two images has more shapes?"))
        return q, f"The {ORDINAL[int(nb > na)]} image has more shapes."
    if kind == "which_has":
        in_a, in_b = {o.name for o in a.objs}, {o.name for o in b.objs}
        only = sorted((in_a - in_b) | (in_b - in_a))
        if not only:
            return None
        name = rng.choice(only)
        o = Obj((0, 0), *name.split()[::-1])
        q = rng.choice(("Which image has {}?", "In which image do you see {}?")).format(a_name(o))
        return q, f"The {ORDINAL[int(name in in_b)]} image has {a_name(o)}."
    if kind == "same_count":
        q = rng.choice(
            (
                "Do the two images have the same number of shapes?",
                "Do both images show as many shapes?",
            )
        )
        if na == nb:
            return q, f"Yes, both images have {NUMBER[na]} shape{'s' * (na > 1)}."
        return q, (
            f"No, the first image has {NUMBER[na]} shape{'s' * (na > 1)} and the second image "
            f"has {NUMBER[nb]} shape{'s' * (nb > 1)}."
        )
    if kind == "describe_both":
        q = rng.choice(("Describe both images.", "What do the two images show?"))
        da, db = describe(a), describe(b)
        return q, (
            f"The first image shows {da[0].lower()}{da[1:]} "
            f"The second image shows {db[0].lower()}{db[1:]}"
        )
    raise ValueError(kind)


def qa_text(rng: random.Random) -> tuple[str, str]:
    """A text-only exchange (no image): shape facts and small sums."""
    if rng.random() < 0.5:
        s = rng.choice(SHAPES)
        n = CORNERS[s]
        q = rng.choice(("How many corners does a {} have?", "How many corners has a {}?")).format(s)
        return q, (f"A {s} has no corners." if n == 0 else f"A {s} has {NUMBER_WORDS[n]} corners.")
    x, y = rng.randint(0, 6), rng.randint(0, 6)
    return f"What is {NUMBER_WORDS[x]} plus {NUMBER_WORDS[y]}?", (
        f"{NUMBER_WORDS[x].capitalize()} plus {NUMBER_WORDS[y]} is {NUMBER_WORDS[x + y]}."
    )


# ---------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(path: str) -> dict:
    return {"type": "image", "image": path}


def turn(role: str, *parts: dict) -> dict:
    return {"role": role, "content": list(parts)}


def _single_row(img: str, scene: Scene, rng: random.Random, follow_up: bool) -> tuple[dict, str]:
    kinds, weights = list(SINGLE_KINDS), list(SINGLE_KINDS.values())
    while True:
        kind = rng.choices(kinds, weights)[0]
        qa = qa_single(scene, kind, rng)
        if qa:
            break
    msgs = [turn("user", image(img), text(qa[0])), turn("assistant", text(qa[1]))]
    if follow_up:  # a second, text-only user turn about the same image
        while True:
            k2 = rng.choices(kinds, weights)[0]
            qa2 = qa_single(scene, k2, rng) if k2 != kind else None
            if qa2:
                break
        msgs += [turn("user", text(qa2[0])), turn("assistant", text(qa2[1]))]
        kind = k2
    return {"messages": msgs}, kind


def build_split(
    name: str,
    n_images: int,
    seed: int,
    out: Path,
    avoid: set | None = None,
    write_images: bool = True,
) -> tuple[list[dict], list[str], list[Scene]]:
    """Render `n_images` images of `name` into `out/images/` and their rows.

    Returns (rows, kinds, scenes): rows in file order, the kind of each row's last user turn
    (`text` for text-only rows) and the scene of each image. Rows per split: one per image,
    a second one for 40% of the images, a two-image row per 5 images and a text-only row per
    20 images; 20% of the image rows carry a follow-up turn; 10% open with a system prompt.
    """
    rng = random.Random(f"zoo_vl/{name}/{seed}")
    scenes: list[Scene] = []
    paths: list[str] = []
    for i in range(n_images):
        for _ in range(1000):
            sc = sample_scene(rng)
            if avoid is None or sc.key() not in avoid:
                break
        else:
            raise ValueError(f"{name}: no scene left outside the {len(avoid)} avoided ones")
        rel = f"images/{name}_{i:06d}.png"
        img = render(sc, rng)
        if write_images:
            (out / "images").mkdir(parents=True, exist_ok=True)
            img.save(out / rel, optimize=True)
        scenes.append(sc)
        paths.append(rel)
    entries: list[tuple[dict, str]] = []
    for i, sc in enumerate(scenes):
        for _ in range(1 + (rng.random() < 0.4)):
            entries.append(_single_row(paths[i], sc, rng, follow_up=rng.random() < 0.2))
    for _ in range(max(1, n_images // 5)):
        while True:
            i, j = rng.sample(range(n_images), 2) if n_images > 1 else (0, 0)
            kind = rng.choice(PAIR_KINDS)
            qa = qa_pair(scenes[i], scenes[j], kind, rng)
            if qa:
                break
        msgs = [
            turn("user", image(paths[i]), image(paths[j]), text(qa[0])),
            turn("assistant", text(qa[1])),
        ]
        entries.append(({"messages": msgs}, kind))
    for _ in range(max(1, n_images // 20)):
        q, a = qa_text(rng)
        entries.append(({"messages": [turn("user", text(q)), turn("assistant", text(a))]}, "text"))
    rng.shuffle(entries)
    for row, _ in entries:
        if rng.random() < 0.1:
            row["messages"].insert(0, turn("system", text(SYSTEM_PROMPT)))
    return [r for r, _ in entries], [k for _, k in entries], scenes


def build(
    out: Path, train_images: int = 2400, test_images: int = 200, seed: int = 0
) -> dict[str, tuple[list[dict], list[str], list[Scene]]]:
    """Write `out/{train,test}.jsonl` and `out/images/*.png`; returns each split's
    (rows, kinds, scenes). Test scenes never equal a train scene (objects and size)."""
    out = Path(out)
    if (out / "images").exists():  # stale images of a larger earlier build
        for p in (out / "images").glob("*.png"):
            p.unlink()
    train = build_split("train", train_images, seed, out)
    seen = {sc.key() for sc in train[2]}
    test = build_split("test", test_images, seed, out, avoid=seen)
    write_jsonl(train[0], out / "train.jsonl")
    write_jsonl(test[0], out / "test.jsonl")
    return {"train": train, "test": test}


def resolve_images(messages: list[dict], base_dir: str | Path) -> list[dict]:
    """A copy of `messages` whose relative image paths are absolute (relative to `base_dir`,
    the jsonl file's folder): processors load a path string relative to the working dir."""
    base = Path(base_dir)
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {**p, "image": str(base / p["image"])}
                if p.get("type") == "image"
                and isinstance(p.get("image"), str)
                and not Path(p["image"]).is_absolute()
                else p
                for p in content
            ]
        out.append({**m, "content": content})
    return out


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a jsonl file with image paths made absolute."""
    path = Path(path)
    return [{"messages": resolve_images(r["messages"], path.parent)} for r in read_jsonl(path)]


# ---------------------------------------------------------------------------------------
# Tokenizer, chat template and the processor's encoding (without torchvision)
# ---------------------------------------------------------------------------------------

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
# Qwen3-VL's special tokens, in Qwen's order, appended after the BPE vocabulary (as in Qwen,
# where they sit above the merges: ids 151643...).
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# Qwen3-VL's chat layout, written out (no tools, no `add_vision_id`): every message is
# `<|im_start|>{role}\n{content}<|im_end|>\n`; an image part is
# `<|vision_start|><|image_pad|><|vision_end|>` (the processor repeats `<|image_pad|>` to the
# grid's token count); content is a string or a list of parts, dispatched on `type` only (rows
# loaded with `datasets` carry `text: None` on image parts and `image: None` on text parts).
# An assistant turn's content and its `<|im_end|>` sit inside `{% generation %}`, so
# `return_assistant_tokens_mask=True` marks exactly what the model generates at that turn;
# the `\n` after `<|im_end|>` is outside (the model stops at `<|im_end|>`).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Pure-Python twin of `CHAT_TEMPLATE` (the tests compare the two)."""

    def body(m: dict) -> str:
        c = m["content"]
        if isinstance(c, str):
            return c
        if m["role"] == "assistant":
            return "".join(p["text"] for p in c if p["type"] == "text")
        vis = {"image": IMAGE_PAD, "video": VIDEO_PAD}
        return "".join(
            f"{VISION_START}{vis[p['type']]}{VISION_END}" if p["type"] in vis else p["text"]
            for p in c
            if p["type"] in ("image", "video", "text")
        )

    out = "".join(f"{IM_START}{m['role']}\n{body(m)}{IM_END}\n" for m in messages)
    return out + (f"{IM_START}assistant\n" if add_generation_prompt else "")


# Qwen2/Qwen3's pre-tokenizer split: like Llama-3's, but digits one at a time.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(train_rows: list[dict], vocab_size: int = 1024):
    """Byte-level BPE (Qwen2 pre-tokenization) trained on the rendered train split.

    The captions use ~100 words, so the trainer runs out of merges well below a typical
    `vocab_size` (~520 tokens + 7 specials); all 256 bytes are in the alphabet, so any text
    encodes. Like Qwen: no bos, `eos = <|im_end|>`, `pad = <|endoftext|>`.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on the pieces between special tokens (specials never take part in merges).
    split = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
    texts = [p for r in train_rows for p in split.split(render_chat(r["messages"])) if p]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def chat_images(messages: list[dict]) -> list:
    """The image parts' `image` values (paths or PIL images), in prompt order."""
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            for p in m["content"]:
                if p["type"] == "video":
                    raise ValueError("video parts are not supported by the zoo's encoder")
                if p["type"] == "image":
                    out.append(p["image"])
    return out


def expand_image_tokens(
    ids: list[int], mask: list[int], grids: list[list[int]], image_token_id: int, merge_size: int
) -> tuple[list[int], list[int], list[int]]:
    """Repeat the k-th `<|image_pad|>` id `t*h*w // merge**2` times (grid k = `[t, h, w]`, in
    patches), as the processor does on the text before tokenizing. `<|image_pad|>` is a
    special token, so the text around it tokenizes the same either way.

    Returns (ids, assistant mask, mm_token_type_ids), each `[T_expanded]`; image rows get mask
    0 and type 1 (transformers' modality ids: 0 text, 1 image, 2 video).
    """
    out_ids, out_mask, types, k = [], [], [], 0
    for t, m in zip(ids, mask):
        if t == image_token_id:
            g = grids[k]
            n = g[0] * g[1] * g[2] // merge_size**2
            out_ids += [t] * n
            out_mask += [0] * n
            types += [1] * n
            k += 1
        else:
            out_ids.append(t)
            out_mask.append(m)
            types.append(0)
    if k != len(grids):
        raise ValueError(f"{k} image placeholders for {len(grids)} images")
    return out_ids, out_mask, types


def encode_chat(tokenizer, image_processor, messages: list[dict], add_generation_prompt=False):
    """What `Qwen3VLProcessor.apply_chat_template(messages, tokenize=True, return_dict=True,
    return_tensors="pt", return_assistant_tokens_mask=True)` returns, built from the tokenizer
    and the image processor alone (transformers 5 cannot build a `Qwen3VLProcessor` without
    torchvision, which its video processor needs).

    Returns a dict of tensors: `input_ids`, `attention_mask`, `mm_token_type_ids`,
    `assistant_masks` (each `[1, T]`) and, with images, `pixel_values`
    `[sum(t*h*w), 3 * temporal_patch * patch**2]` and `image_grid_thw` `[n_images, 3]`.
    """
    import torch
    from transformers.image_utils import load_image

    enc = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=add_generation_prompt,
    )
    images = [load_image(x) for x in chat_images(messages)]
    out = {}
    grids: list[list[int]] = []
    if images:
        vis = image_processor(images=images, return_tensors="pt")
        out["pixel_values"] = vis["pixel_values"]
        out["image_grid_thw"] = vis["image_grid_thw"]
        grids = vis["image_grid_thw"].tolist()
    ids, mask, types = expand_image_tokens(
        enc["input_ids"],
        enc["assistant_masks"],
        grids,
        tokenizer.convert_tokens_to_ids(IMAGE_PAD),
        image_processor.merge_size,
    )
    out["input_ids"] = torch.tensor([ids])
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    out["mm_token_type_ids"] = torch.tensor([types])
    out["assistant_masks"] = torch.tensor([mask])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="e.g. draftinfer/zoo/vl_caption")
    p.add_argument("--train-images", type=int, default=2400)
    p.add_argument("--test-images", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    splits = build(a.out, a.train_images, a.test_images, a.seed)
    size = sum(f.stat().st_size for f in a.out.rglob("*") if f.is_file())
    print(
        json.dumps(
            {
                name: {"rows": len(rows), "images": len(scenes), "kinds": Counter(kinds)}
                for name, (rows, kinds, scenes) in splits.items()
            }
            | {"bytes": size},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
