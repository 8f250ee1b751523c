"""Rebuild the target zoo: chat data from the stdlib, a BPE tokenizer and a trained tiny Llama.

    python -m drafttrain.zoo.build_text --out draftinfer/zoo     # full rebuild (~20 min, 2 threads)
    python -m drafttrain.zoo.build_text --out /tmp/zoo --steps 50  # smoke run

Writes `<out>/chat/{train,test}.jsonl`, `<out>/llama-tiny/` (config, bf16 safetensors,
generation config, tokenizer with the Llama-3 chat template) and `<out>/build_log.json`
(metrics, loss curve, timings, example generations). Deterministic for a given Python
installation (the corpus) and thread count (CPU float reductions depend on it).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from drafttrain.zoo import text_data, text_train

MODEL_DIR = "llama-tiny"
N_EVAL_TRAIN = 400  # train rows re-scored after training (same size as the test split)
N_EXAMPLES = 8


def parse_args(argv=None) -> argparse.Namespace:
    d = text_train.TrainArgs()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="e.g. draftinfer/zoo (the shipped zoo)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument(
        "--gen-rows", type=int, default=48, help="test rows answered greedily for the report"
    )
    return p.parse_args(argv)


def save_tokenizer(tok, out: Path) -> None:
    """Save, then make tokenizer_config.json what Llama-3 ships: the chat template inline and
    the class transformers 4.x and 5.x both know (5.x writes its own `TokenizersBackend`)."""
    tok.save_pretrained(out)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = text_data.CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)  # one copy of the template


def save_model(model, tokenizer, out: Path) -> None:
    """bf16 safetensors + config with legacy `rope_scaling`/`rope_theta` keys beside
    transformers-5 `rope_parameters`, so 4.x-era loaders (and engines) read the same RoPE."""
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.generation_config = text_train.generation_config(tokenizer)
    model.generation_config.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = dict(cfg["rope_parameters"])
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.to(torch.float32)


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    out, mdir = a.out, a.out / MODEL_DIR
    times = {}
    t = time.time()

    train_rows, test_rows = text_data.build_chat()
    text_data.write_jsonl(train_rows, out / "chat" / "train.jsonl")
    text_data.write_jsonl(test_rows, out / "chat" / "test.jsonl")
    times["data_s"] = time.time() - t
    print(f"chat: {len(train_rows)} train / {len(test_rows)} test conversations", flush=True)

    t = time.time()
    tok = text_data.train_tokenizer(train_rows, vocab_size=a.vocab_size)
    mdir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, mdir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mdir)  # everything below uses the shipped files
    train_ex = [text_data.encode_with_mask(tok, r["messages"]) for r in train_rows]
    test_ex = [text_data.encode_with_mask(tok, r["messages"]) for r in test_rows]
    sample = train_rows[0]["messages"]
    assert tok.apply_chat_template(sample, tokenize=False) == text_data.render_chat(sample)
    times["tokenizer_s"] = time.time() - t

    config = text_train.llama_config(tok)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.2f}M parameters; {sum(len(x) for x, _ in train_ex)} train tokens",
        flush=True,
    )
    targs = text_train.TrainArgs(
        steps=a.steps, lr=a.lr, tokens_per_batch=a.tokens_per_batch, seed=a.seed
    )
    t = time.time()
    log = text_train.train(model, train_ex, tok.pad_token_id, targs)
    times["train_s"] = time.time() - t

    save_model(model, tok, mdir)
    # Score the shipped (bf16-rounded) weights, loaded back from disk as a user would.
    t = time.time()
    model, info = AutoModelForCausalLM.from_pretrained(
        mdir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), f"loading {mdir}: {info}"
    metrics = {
        "train": text_train.evaluate(model, train_ex[:N_EVAL_TRAIN], tok.pad_token_id),
        "test": text_train.evaluate(model, test_ex, tok.pad_token_id),
    }
    gen_stats = text_train.generate_answers(model, tok, test_rows[: a.gen_rows])
    examples = gen_stats[:N_EXAMPLES]
    metrics["test_generation"] = {
        "rows": len(gen_stats),
        "ends_with_eot": sum(g["ends_with_eot"] for g in gen_stats) / max(1, len(gen_stats)),
        "exact_match": sum(g["exact"] for g in gen_stats) / max(1, len(gen_stats)),
    }
    times["eval_s"] = time.time() - t

    report = {
        "command": "python -m drafttrain.zoo.build_text "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: str(v) for k, v in vars(a).items()},
        "train_args": vars(targs),
        "shape": text_train.shape_dict(),
        "n_params": n_params,
        "rows": {"train": len(train_rows), "test": len(test_rows)},
        "tokens": {
            "train": sum(len(x) for x, _ in train_ex),
            "train_assistant": sum(sum(m) for _, m in train_ex),
            "test": sum(len(x) for x, _ in test_ex),
        },
        "metrics": metrics,
        "times_s": times,
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": a.threads,
        },
        "examples": examples,
        "log": log,
    }
    (out / "build_log.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"metrics": metrics, "times_s": times}, indent=2))
    return report


if __name__ == "__main__":
    main()
