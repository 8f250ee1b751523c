"""Build the zoo's tiny Qwen3-VL target: synthetic image-caption chat, a BPE tokenizer with
Qwen3-VL's special tokens and chat layout, processor configs and a trained
`Qwen3VLForConditionalGeneration`.

    python -m drafttrain.zoo.build_vl --out draftinfer/zoo       # full build (~25 min, 1 thread)
    python -m drafttrain.zoo.build_vl --out /tmp/x --steps 5     # smoke run (< 1 min)

Writes `<out>/vl_caption/{train,test}.jsonl` + `images/*.png` (`vl_data.py`),
`<out>/qwen3-vl-tiny/` (config, bf16 safetensors, generation config, tokenizer,
`chat_template.jinja`, `preprocessor_config.json` and `video_preprocessor_config.json` as
Qwen3-VL checkpoints ship them) and `<out>/build_log_vl.json` (args, loss curve, held-out
metrics, timings, example generations).

The model, its files and its training are `vl_train.py` (on the project's trainer,
`target_train.py`); the data and the tokenizer `vl_data.py`. Deterministic for a given seed and
thread count.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from drafttrain.zoo import target_build
from drafttrain.zoo import vl_data as vd
from drafttrain.zoo.vl_train import (
    PixelCache,
    TrainArgs,
    VLShape,
    blank_images,
    encode,
    evaluate,
    exact_match_table,
    generate_answers,
    qwen3_vl_config,
    reinit_vision,
    save_model,
    save_processor_configs,
    save_tokenizer,
    train,
)

DATA_DIR = "vl_caption"
MODEL_DIR = "qwen3-vl-tiny"
N_EXAMPLES = 10


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    d = TrainArgs()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="e.g. draftinfer/zoo (the shipped zoo)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where to train and evaluate (e.g. cuda)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch)
    p.add_argument("--vision-lr-scale", type=float, default=d.vision_lr_scale)
    p.add_argument("--train-images", type=int, default=2400)
    p.add_argument("--test-images", type=int, default=200)
    p.add_argument("--gen-rows", type=int, default=100, help="test rows answered greedily")
    p.add_argument("--eval-train-rows", type=int, default=300, help="train rows re-scored")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines only)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    caller_threads = torch.get_num_threads()  # restored for in-process callers (tests)
    torch.set_num_threads(a.threads)
    try:
        return build(a, argv)
    finally:
        torch.set_num_threads(caller_threads)


def build(a: argparse.Namespace, argv=None) -> dict:
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    out, ddir, mdir = a.out, a.out / DATA_DIR, a.out / MODEL_DIR
    shape, times, t_all = VLShape(), {}, time.time()

    t = time.time()
    splits = vd.build(ddir, a.train_images, a.test_images, a.seed)
    (train_rows, _, _), (test_rows, test_kinds, _) = splits["train"], splits["test"]
    times["data_s"] = time.time() - t
    print(f"vl_caption: {len(train_rows)} train / {len(test_rows)} test rows", flush=True)

    t = time.time()
    mdir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(vd.train_tokenizer(train_rows), mdir)
    save_processor_configs(mdir, shape)
    tok = AutoTokenizer.from_pretrained(mdir)  # everything below uses the shipped files
    ip = AutoImageProcessor.from_pretrained(mdir)
    sample = train_rows[0]["messages"]
    assert tok.apply_chat_template(sample, tokenize=False) == vd.render_chat(sample)
    cache = PixelCache(ip)
    train_abs = vd.load_rows(ddir / "train.jsonl")
    test_abs = vd.load_rows(ddir / "test.jsonl")
    train_ex = [encode(tok, cache, r["messages"]) for r in train_abs]
    test_ex = [encode(tok, cache, r["messages"]) for r in test_abs]
    times["tokenize_s"] = time.time() - t

    torch.manual_seed(a.seed)
    config = qwen3_vl_config(tok, shape)
    model = Qwen3VLForConditionalGeneration._from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    reinit_vision(model)
    model.to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    n_vision = sum(p.numel() for p in model.model.visual.parameters())
    pad_id = tok.convert_tokens_to_ids(vd.ENDOFTEXT)
    print(
        f"model: {n_params / 1e6:.2f}M parameters ({n_vision / 1e6:.2f}M vision); "
        f"{sum(len(x[0]) for x in train_ex)} train tokens, {len(cache.data)} images",
        flush=True,
    )
    targs = TrainArgs(
        steps=a.steps,
        lr=a.lr,
        tokens_per_batch=a.tokens_per_batch,
        seed=a.seed,
        vision_lr_scale=a.vision_lr_scale,
    )
    blank = blank_images(cache)
    probe_ex = test_ex[:96]

    def probe() -> dict:
        real = evaluate(model, probe_ex, pad_id, cache)["loss"]
        return {
            "test_loss": real,
            "image_gain": evaluate(model, probe_ex, pad_id, blank)["loss"] - real,
        }

    t = time.time()
    log, losses = train(
        model, train_ex, pad_id, cache, targs, progress=not a.no_progress, probe=probe
    )
    times["train_s"] = time.time() - t

    save_model(model, tok, mdir)
    # Score the shipped (bf16-rounded) weights, loaded back from disk as a user would.
    t = time.time()
    model, info = Qwen3VLForConditionalGeneration.from_pretrained(
        mdir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), f"loading {mdir}: {info}"
    model.to(a.device).eval()
    metrics = {
        "train": evaluate(model, train_ex[: a.eval_train_rows], pad_id, cache),
        "test": evaluate(model, test_ex, pad_id, cache),
        "test_blank_images": evaluate(model, test_ex, pad_id, blank),
    }
    gens = generate_answers(model, tok, cache, test_abs[: a.gen_rows], test_kinds[: a.gen_rows])
    metrics["test_generation"] = exact_match_table(gens)
    times["eval_s"] = time.time() - t
    times["total_s"] = time.time() - t_all

    import transformers

    report = {
        "command": "python -m drafttrain.zoo.build_vl "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: str(v) for k, v in vars(a).items()},
        "train_args": asdict(targs),
        "shape": asdict(shape),
        "n_params": {"total": n_params, "vision": n_vision},
        "vocab": {"tokenizer": len(tok), "model": config.text_config.vocab_size},
        "rows": {"train": len(train_rows), "test": len(test_rows)},
        "images": {"train": a.train_images, "test": a.test_images},
        "tokens": {
            **target_build.token_counts(train_ex, test_ex),
            "train_image": sum(sum(x[2]) for x in train_ex),
        },
        "metrics": metrics,
        "times_s": {k: round(v, 1) for k, v in times.items()},
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": a.threads,
            "device": a.device,
        },
        "examples": gens[:N_EXAMPLES],
        "log": log,
        "losses": losses,  # per optimizer step
    }
    (out / "build_log_vl.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"metrics": metrics, "times_s": report["times_s"]}, indent=2))
    return report


if __name__ == "__main__":
    main()
