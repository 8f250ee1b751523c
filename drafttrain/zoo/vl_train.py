"""The zoo's tiny Qwen3-VL target: its shape and config, the files Qwen3-VL checkpoints ship
(tokenizer, processor configs), and its training and evaluation (`build_vl` is the CLI).

Training: transformers' own model, fp32, next-token cross-entropy on assistant tokens only
(each assistant turn's content + `<|im_end|>`, from the chat template's `{% generation %}`
mask), the vision tower trained with the decoder (fan-in init, 0.1x the rate: see
`TrainArgs.vision_lr_scale`); AdamW (betas 0.9/0.95, weight decay on matrices), warmup then
cosine to 10%, grad clip 1.0, padded-token-budget batches, on the project's trainer
(`drafttrain.zoo.target_train`). Deterministic for a given seed and thread count.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from drafttrain.trainer.loop import LoopHook
from drafttrain.zoo import vl_data as vd
from drafttrain.zoo.target_train import TokenBudgetBatches, decay_groups, train_target


@dataclass
class VLShape:
    """Qwen3-VL anatomy at toy scale (DESIGN 5): 8 decoder layers so the default aux taps
    (2, 4, 5) are distinct and tap 2 gets a DeepStack add; head_dim 32 with interleaved
    `mrope_section [6, 5, 5]` (sums to 16 = head_dim / 2, every axis has frequencies);
    3 vision blocks, all three DeepStack levels; patch 8 and merge 2, so 48x48 / 48x96 /
    96x48 images give grids [1, 6, 6] / [1, 6, 12] / [1, 12, 6] (9 / 18 / 18 tokens)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # GQA
    head_dim: int = 32
    mrope_section: tuple[int, int, int] = (6, 5, 5)
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    vocab_multiple: int = 128  # embedding rows padded like Qwen's (151936 > len(tokenizer))
    vision_depth: int = 3
    vision_hidden_size: int = 64
    vision_heads: int = 4
    vision_intermediate_size: int = 256
    patch_size: int = 8
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 144  # 12 x 12: the largest grid side (96 px / 8)
    deepstack_visual_indexes: tuple[int, ...] = (0, 1, 2)
    min_pixels: int = 32 * 32  # the data's images (2304-4608 pixels) keep their size
    max_pixels: int = 96 * 96


def qwen3_vl_config(tok, s: VLShape):
    from transformers import Qwen3VLConfig

    ids = tok.convert_tokens_to_ids
    vocab = -(-len(tok) // s.vocab_multiple) * s.vocab_multiple
    rope = {
        "rope_type": "default",
        "rope_theta": s.rope_theta,
        "mrope_section": list(s.mrope_section),
        "mrope_interleaved": True,
    }
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size,
            num_hidden_layers=s.num_hidden_layers,
            num_attention_heads=s.num_attention_heads,
            num_key_value_heads=s.num_key_value_heads,
            head_dim=s.head_dim,
            max_position_embeddings=s.max_position_embeddings,
            rms_norm_eps=s.rms_norm_eps,
            rope_parameters=rope,
            hidden_act="silu",
            attention_bias=False,
            pad_token_id=ids(vd.ENDOFTEXT),
            bos_token_id=ids(vd.ENDOFTEXT),
            eos_token_id=ids(vd.IM_END),
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=s.vision_depth,
            hidden_size=s.vision_hidden_size,
            num_heads=s.vision_heads,
            intermediate_size=s.vision_intermediate_size,
            out_hidden_size=s.hidden_size,
            patch_size=s.patch_size,
            temporal_patch_size=s.temporal_patch_size,
            spatial_merge_size=s.spatial_merge_size,
            num_position_embeddings=s.num_position_embeddings,
            deepstack_visual_indexes=list(s.deepstack_visual_indexes),
        ),
        image_token_id=ids(vd.IMAGE_PAD),
        video_token_id=ids(vd.VIDEO_PAD),
        vision_start_token_id=ids(vd.VISION_START),
        vision_end_token_id=ids(vd.VISION_END),
        tie_word_embeddings=True,  # the top-level flag is the one transformers ties by
    )


def generation_config(tok):
    from transformers import GenerationConfig

    ids = tok.convert_tokens_to_ids
    return GenerationConfig(
        bos_token_id=ids(vd.ENDOFTEXT),
        eos_token_id=[ids(vd.IM_END), ids(vd.ENDOFTEXT)],
        pad_token_id=ids(vd.ENDOFTEXT),
        do_sample=False,
        max_new_tokens=128,
    )


# ---------------------------------------------------------------------------------------
# Saving: tokenizer and processor files in the layout of Qwen3-VL checkpoints
# ---------------------------------------------------------------------------------------


def save_tokenizer(tok, out: Path) -> None:
    """Tokenizer files + `chat_template.jinja` (the one copy tokenizer and processor read);
    `tokenizer_class: PreTrainedTokenizerFast` loads on transformers 4.x and 5.x."""
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("backend", None)
    cfg.pop("chat_template", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(vd.CHAT_TEMPLATE)


def save_processor_configs(out: Path, s: VLShape) -> None:
    """`preprocessor_config.json` and `video_preprocessor_config.json` with the fields real
    Qwen3-VL checkpoints ship (mean/std 0.5, `Qwen2VLImageProcessorFast`,
    `Qwen3VLVideoProcessor`), at our patch size. `AutoProcessor` builds a `Qwen3VLProcessor`
    from them where torchvision is installed; `AutoImageProcessor` loads the image part
    anywhere (transformers 5 falls back to its PIL backend without torchvision)."""
    common = {
        "patch_size": s.patch_size,
        "temporal_patch_size": s.temporal_patch_size,
        "merge_size": s.spatial_merge_size,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
    }
    image = {
        "size": {"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
        **common,
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }
    video = {  # videos are not in the data; sized for up to 4 frames of 96x96
        "size": {"shortest_edge": s.min_pixels, "longest_edge": 4 * s.max_pixels},
        **common,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    for name, cfg in (
        ("preprocessor_config.json", image),
        ("video_preprocessor_config.json", video),
    ):
        (out / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def reinit_vision(model) -> None:
    """PyTorch's default (fan-in) init for the vision tower's linear and conv layers: its
    features then carry the image at unit scale from step 0 (see `TrainArgs.vision_lr_scale`).
    Norms and the position embedding keep transformers' init."""
    for m in model.model.visual.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d)):
            m.reset_parameters()


def save_model(model, tok, out: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    generation_config(tok).save_pretrained(out)
    model.to(torch.float32)


# ---------------------------------------------------------------------------------------
# Encoding, batches, training, evaluation
# ---------------------------------------------------------------------------------------

# (ids, assistant mask, mm_token_type_ids, image keys), the first three [T]; the batches are
# cut by len(example[0]).
Example = tuple[list[int], list[int], list[int], list[str]]


class PixelCache:
    """`pixel_values` `[t*h*w, patch_dim]` and grid `[3]` of each image, computed once."""

    def __init__(self, image_processor):
        self.ip = image_processor
        self.data: dict[str, tuple[torch.Tensor, list[int]]] = {}

    def get(self, key: str) -> tuple[torch.Tensor, list[int]]:
        if key not in self.data:
            from transformers.image_utils import load_image

            v = self.ip(images=[load_image(key)], return_tensors="pt")
            self.data[key] = (v["pixel_values"], v["image_grid_thw"][0].tolist())
        return self.data[key]


def blank_images(cache: PixelCache) -> PixelCache:
    """A cache of the same images with all-zero pixel values (mid-grey after normalisation):
    the held-out loss with these minus the loss with the real images is how much the model
    reads its images (0 for a model that ignores them)."""
    blank = PixelCache(cache.ip)
    blank.data = {k: (torch.zeros_like(pv), g) for k, (pv, g) in cache.data.items()}
    return blank


def encode(tok, cache: PixelCache, messages: list[dict], add_generation_prompt=False) -> Example:
    """`vd.encode_chat` with images from the cache (each image is processed once)."""
    enc = tok.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=add_generation_prompt,
    )
    keys = [str(x) for x in vd.chat_images(messages)]
    grids = [cache.get(k)[1] for k in keys]
    ids, mask, types = vd.expand_image_tokens(
        enc["input_ids"],
        enc["assistant_masks"],
        grids,
        tok.convert_tokens_to_ids(vd.IMAGE_PAD),
        cache.ip.merge_size,
    )
    return ids, mask, types, keys


def collate(examples: list[Example], idx: list[int], pad_id: int, cache: PixelCache) -> dict:
    """Right-padded model inputs `[B, T]`, next-token labels `[B, T]` (-100 where not
    trained: label at t is token t+1 if that token is an assistant token) and the rows'
    images concatenated in row order (`pixel_values` `[sum patches, patch_dim]`,
    `image_grid_thw` `[n_images, 3]`), which is the order of their placeholders in the batch."""
    T = max(len(examples[i][0]) for i in idx)
    B = len(idx)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    types = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    pix, grids = [], []
    for r, i in enumerate(idx):
        x, m, ty, keys = examples[i]
        n = len(x)
        ids[r, :n] = torch.tensor(x)
        att[r, :n] = 1
        types[r, :n] = torch.tensor(ty)
        tgt = torch.tensor(x[1:] + [pad_id])
        keep = torch.tensor(m[1:] + [0], dtype=torch.bool)
        labels[r, :n] = torch.where(keep, tgt, torch.full_like(tgt, -100))
        for k in keys:
            pv, g = cache.get(k)
            pix.append(pv)
            grids.append(g)
    batch = {"input_ids": ids, "attention_mask": att, "mm_token_type_ids": types}
    if pix:
        batch["pixel_values"] = torch.cat(pix)
        batch["image_grid_thw"] = torch.tensor(grids)
    return batch | {"labels": labels}


@dataclass
class TrainArgs:  # the fields `target_train.TargetArgs` names, plus ours
    steps: int = 3000
    tokens_per_batch: int = 1024  # padded tokens per optimizer step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    # The vision tower learns at a tenth of the decoder's rate, from PyTorch's default
    # (fan-in) init (`reinit_vision`). With transformers' init (std 0.02) and the full rate, it
    # collapses within ~100 steps to a near-constant output: Adam moves every weight by ~lr per
    # step, i.e. by its whole init scale in a few dozen steps, along the gradient's common
    # mode, before the decoder reads any image content. Measured (one-object colour task, 200
    # steps): full rate -> held-out loss with blank images = with real ones (0.31, the text
    # prior); frozen random tower 0.17; fan-in init + 0.1x rate 0.13; 0.3x collapses again.
    vision_lr_scale: float = 0.1


class Probe(LoopHook):
    """Held-out metrics every `every_n_steps` steps (and after the last), merged into that
    step's log row."""

    def __init__(self, fn: Callable[[], dict], every_n_steps: int = 250):
        self.fn, self.every_n_steps = fn, every_n_steps

    def __call__(self, step: int, last_log: dict[str, float]) -> dict[str, float]:
        return self.fn()


def param_groups(model, a: TrainArgs) -> list[dict]:
    """Weight decay on matrices; the vision tower's groups at `vision_lr_scale` x the rate."""
    vision = {id(p) for p in model.model.visual.parameters()}
    named = list(model.named_parameters())
    text = decay_groups([(n, p) for n, p in named if id(p) not in vision], a.weight_decay)
    tower = decay_groups([(n, p) for n, p in named if id(p) in vision], a.weight_decay)
    return text + [{**g, "lr": a.lr * a.vision_lr_scale} for g in tower]


def train(
    model, examples, pad_id: int, cache: PixelCache, a: TrainArgs, progress=True, probe=None
) -> tuple[list, list[float]]:
    """Train in place on the model's device; returns the log (a row per 25 steps and the last;
    every 250 steps and after the last it includes `probe()`, e.g. held-out metrics) and the
    per-step losses."""
    batches = TokenBudgetBatches(
        examples, a.tokens_per_batch, a.seed, lambda idx: collate(examples, idx, pad_id, cache)
    )
    hooks = [Probe(probe)] if probe is not None else []
    device = next(model.parameters()).device
    return train_target(model, batches, a, param_groups(model, a), device, progress, hooks)


@torch.no_grad()
def evaluate(model, examples, pad_id: int, cache: PixelCache, batch: int = 32) -> dict:
    """Teacher-forced assistant-token loss and greedy (argmax) next-token accuracy."""
    model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    tot_loss = tot_ok = tot = 0.0
    for b in range(0, len(order), batch):
        inputs = collate(examples, order[b : b + batch], pad_id, cache)
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        labels = inputs.pop("labels")
        logits = model(**inputs, use_cache=False).logits.float()
        mask = labels != -100
        tot_loss += F.cross_entropy(logits[mask], labels[mask], reduction="sum").item()
        tot_ok += (logits[mask].argmax(-1) == labels[mask]).sum().item()
        tot += mask.sum().item()
    return {"loss": tot_loss / tot, "acc": tot_ok / tot, "tokens": int(tot)}


def answer_text(message: dict) -> str:
    return "".join(p["text"] for p in message["content"] if p["type"] == "text")


@torch.no_grad()
def generate_answers(model, tok, cache: PixelCache, rows, kinds, slack: int = 8) -> list[dict]:
    """Greedy answers (HF `generate`, batch 1) to each row's last user turn, earlier turns as
    context; at most the reference's length + `slack` new tokens (enough for an exact match
    and its `<|im_end|>`)."""
    im_end = tok.convert_tokens_to_ids(vd.IM_END)
    out = []
    for row, kind in zip(rows, kinds):
        msgs, ref = row["messages"][:-1], answer_text(row["messages"][-1])
        ids, _, types, keys = encode(tok, cache, msgs, add_generation_prompt=True)
        inputs = {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "mm_token_type_ids": torch.tensor([types]),
        }
        if keys:
            inputs["pixel_values"] = torch.cat([cache.get(k)[0] for k in keys])
            inputs["image_grid_thw"] = torch.tensor([cache.get(k)[1] for k in keys])
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        budget = len(tok(ref, add_special_tokens=False)["input_ids"]) + slack
        gen = model.generate(**inputs, max_new_tokens=budget, do_sample=False)
        new = gen[0, len(ids) :].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        out.append(
            {
                "kind": kind,
                "prompt": answer_text(msgs[-1]),
                "reference": ref,
                "generated": text,
                "ends_with_im_end": bool(new) and new[-1] == im_end,
                "exact": text.strip() == ref.strip() and bool(new) and new[-1] == im_end,
            }
        )
    return out


def exact_match_table(gens: list[dict]) -> dict:
    by_kind: dict[str, list[bool]] = {}
    for g in gens:
        by_kind.setdefault(g["kind"], []).append(g["exact"])
    return {
        "rows": len(gens),
        "exact_match": sum(g["exact"] for g in gens) / max(1, len(gens)),
        "ends_with_im_end": sum(g["ends_with_im_end"] for g in gens) / max(1, len(gens)),
        "by_kind": {
            k: {"rows": len(v), "exact": sum(v) / len(v)} for k, v in sorted(by_kind.items())
        },
    }
