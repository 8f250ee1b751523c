"""Rebuild the target zoo: chat data from the stdlib, a BPE tokenizer and a trained tiny Llama.

    python -m drafttrain.zoo.build_text --out draftinfer/zoo     # full rebuild (~20 min, 2 threads)
    python -m drafttrain.zoo.build_text --out /tmp/zoo --steps 50  # smoke run

Writes `<out>/chat/{train,test}.jsonl`, `<out>/llama-tiny/` (config, bf16 safetensors,
generation config, tokenizer with the Llama-3 chat template) and `<out>/build_log.json`
(metrics, loss curve, per-step losses, timings, example generations). The target trains on
the project's trainer (`drafttrain.zoo.target_train`). Deterministic for a given Python
installation (the corpus) and thread count (CPU float reductions depend on it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from drafttrain.zoo import target_build, text_data, text_train

MODEL_DIR = "llama-tiny"


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


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    out, mdir = a.out, a.out / MODEL_DIR
    timer = target_build.Timer()

    with timer("data_s"):
        train_rows, test_rows = text_data.build_chat()
        text_data.write_jsonl(train_rows, out / "chat" / "train.jsonl")
        text_data.write_jsonl(test_rows, out / "chat" / "test.jsonl")
    print(f"chat: {len(train_rows)} train / {len(test_rows)} test conversations", flush=True)

    with timer("tokenizer_s"):
        tok = text_data.train_tokenizer(train_rows, vocab_size=a.vocab_size)
        mdir.mkdir(parents=True, exist_ok=True)
        target_build.save_tokenizer(tok, mdir, text_data.CHAT_TEMPLATE)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(mdir)  # everything below uses the shipped files
        train_ex = [text_data.encode_with_mask(tok, r["messages"]) for r in train_rows]
        test_ex = [text_data.encode_with_mask(tok, r["messages"]) for r in test_rows]
        sample = train_rows[0]["messages"]
        assert tok.apply_chat_template(sample, tokenize=False) == text_data.render_chat(sample)

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
    with timer("train_s"):
        log, losses = text_train.train(model, train_ex, tok.pad_token_id, targs)

    target_build.save_model(model, mdir, text_train.generation_config(tok))
    # Score the shipped (bf16-rounded) weights, loaded back from disk as a user would.
    with timer("eval_s"):
        model = target_build.load_shipped(mdir)
        metrics, examples = target_build.score(model, tok, train_ex, test_ex, test_rows, a.gen_rows)

    report = target_build.write_report(
        out / "build_log.json",
        command="python -m drafttrain.zoo.build_text "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        args=a,
        targs=targs,
        shape=text_train.shape_dict(),
        n_params=n_params,
        rows={"train": len(train_rows), "test": len(test_rows)},
        tokens=target_build.token_counts(train_ex, test_ex),
        metrics=metrics,
        times=timer.times,
        threads=a.threads,
        examples=examples,
        log=log,
        losses=losses,
    )
    print(json.dumps({"metrics": metrics, "times_s": timer.times}, indent=2))
    return report


if __name__ == "__main__":
    main()
