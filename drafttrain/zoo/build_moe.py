"""Build the zoo's MoE targets: `gpt-oss-tiny`, `qwen3-moe-tiny`, `deepseek-tiny` and
`glm-tiny` (`moe_targets` says what each is), trained on the zoo's chat like `llama-tiny`.

    python -m drafttrain.zoo.build_moe --out draftinfer/zoo                     # all (~70 min)
    python -m drafttrain.zoo.build_moe --out draftinfer/zoo --family glm4_moe   # one
    python -m drafttrain.zoo.build_moe --out /tmp/zoo --family qwen3_moe --steps 20  # smoke run

Reads the zoo's chat (`--chat`, default the shipped `zoo:chat`: its rows are the same for every
target, whatever Python version builds this one), writes the target's own chat when it has one
(`<out>/chat_harmony/{train,test}.jsonl` for gpt-oss: the rows plus an analysis message), trains
a BPE tokenizer of 4,096 ids on the chat rendered in the target's format, computes the
assistant-only loss masks with the training side's own code (`drafttrain.data.chat`, so the
target learns to write exactly what drafters are trained to predict), trains the model on the
project's trainer (`text_train.train`, with the MoE load-balancing term) and writes
`<out>/<model dir>/` (config, bf16 safetensors, generation config, tokenizer with the chat
template) and `<out>/build_log_<family>.json` (metrics, loss curve, expert load, timings,
example generations). Deterministic for a given thread count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftinfer.files.paths import resolve_path
from drafttrain.zoo import deepseek_target, mtp_joint, target_build, text_data, text_train
from drafttrain.zoo.moe_targets import TARGETS, ZooMoE

MAX_LENGTH = 2048  # no zoo conversation comes near it: nothing is cut


def parse_args(argv=None) -> argparse.Namespace:
    d = train_args()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="e.g. draftinfer/zoo (the shipped zoo)")
    p.add_argument("--family", choices=sorted(TARGETS), action="append", help="default: all")
    p.add_argument("--chat", default="zoo:chat", help="the zoo chat ({train,test}.jsonl)")
    # Default: `train_args()`'s (steps 900, lr 3e-3, 4096 tokens), or the target's own
    # (`ZooMoE.train_defaults`).
    p.add_argument("--steps", type=int, default=None, help=f"default {d.steps}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=None, help=f"default {d.lr}")
    p.add_argument(
        "--tokens-per-batch", type=int, default=None, help=f"default {d.tokens_per_batch}"
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument(
        "--gen-rows", type=int, default=48, help="test rows answered greedily for the report"
    )
    return p.parse_args(argv)


def train_args(**kw) -> text_train.TrainArgs:
    """The MoE builds' defaults: the Llama's recipe, sized to ~20 min on 2 shared cores."""
    return text_train.TrainArgs(**{"steps": 900, **kw})


def overrides(a: argparse.Namespace) -> dict:
    """The training settings the command line names (the rest: the target's defaults)."""
    named = {"steps": a.steps, "lr": a.lr, "tokens_per_batch": a.tokens_per_batch}
    return {"seed": a.seed, **{k: v for k, v in named.items() if v is not None}}


def template_renderer(chat_template: str):
    """`render(messages) -> text` through transformers' own chat-template rendering."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    bare.chat_template = chat_template
    return lambda messages: bare.apply_chat_template(messages, tokenize=False)


def encode(tok, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) per row, by the training side's loss-mask rule."""
    from drafttrain.data.chat import end_of_turn_markers, tokenize_conversation

    ends = end_of_turn_markers(tok)
    out = []
    for r in rows:
        enc = tokenize_conversation(tok, r["messages"], MAX_LENGTH, ends)
        out.append((enc["input_ids"], enc["loss_mask"]))
    return out


@torch.no_grad()
def expert_load(model, examples, pad_id: int, top_k: int, batch: int = 32) -> dict:
    """Share of the top-k routing slots each expert takes, per layer, over the examples' real
    tokens: `{"per_layer": [[share] * E] * L, "min": ..., "max": ...}` (uniform: 1 / E)."""
    counts = None
    for b in range(0, len(examples), batch):
        inputs = text_train.collate(examples, list(range(b, min(b + batch, len(examples)))), pad_id)
        ids = inputs["input_ids"]
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
        real = (ids != pad_id).flatten()
        layers = []
        for logits in out.router_logits:  # [B * T, E] per layer
            top = logits[real].topk(top_k, dim=-1).indices.flatten()
            layers.append(torch.bincount(top, minlength=logits.shape[-1]).float())
        step = torch.stack(layers)
        counts = step if counts is None else counts + step
    shares = counts / counts.sum(-1, keepdim=True)
    return {
        "per_layer": [[round(x, 4) for x in row] for row in shares.tolist()],
        "min": round(float(shares.min()), 4),
        "max": round(float(shares.max()), 4),
    }


def build(spec: ZooMoE, a: argparse.Namespace, argv) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(a.seed)
    out, mdir = a.out, a.out / spec.model_dir
    timer = target_build.Timer()
    chat = Path(resolve_path(a.chat))
    with timer("data_s"):
        train_rows = text_data.read_jsonl(chat / "train.jsonl")
        test_rows = text_data.read_jsonl(chat / "test.jsonl")
        if spec.rows is not None:
            train_rows, test_rows = spec.rows(train_rows), spec.rows(test_rows)
            text_data.write_jsonl(train_rows, out / spec.data_dir / "train.jsonl")
            text_data.write_jsonl(test_rows, out / spec.data_dir / "test.jsonl")
    print(f"{spec.family}: {len(train_rows)} train / {len(test_rows)} test rows", flush=True)

    with timer("tokenizer_s"):
        tok = text_data.train_tokenizer(
            train_rows,
            vocab_size=a.vocab_size,
            render=template_renderer(spec.chat_template),
            specials=list(spec.specials),
            bos=spec.bos,
            eos=spec.eos,
            pad=spec.pad,
            chat_template=spec.chat_template,
        )
        mdir.mkdir(parents=True, exist_ok=True)
        target_build.save_tokenizer(tok, mdir, spec.chat_template)
        tok = AutoTokenizer.from_pretrained(mdir)  # everything below uses the shipped files
        train_ex, test_ex = encode(tok, train_rows), encode(tok, test_rows)

    config = spec.config(tok, spec.shape)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=spec.attn_implementation
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.2f}M parameters; {sum(len(x) for x, _ in train_ex)} train tokens",
        flush=True,
    )
    targs = train_args(**{**spec.train_defaults, **overrides(a)})
    mtp = None
    with timer("train_s"):
        if spec.mtp_layers:
            log, losses, mtp = deepseek_target.train_with_mtp(
                model, train_ex, tok.pad_token_id, targs, spec.mtp_layers
            )
        else:
            log, losses = text_train.train(
                model, train_ex, tok.pad_token_id, targs, aux_loss_coef=spec.aux_loss_coef
            )

    stop_ids = [tok.convert_tokens_to_ids(t) for t in spec.stop_tokens]
    gen_cfg = target_build.generation_config(tok, list(spec.stop_tokens), spec.bos, spec.pad)
    target_build.save_model(model, mdir, gen_cfg)
    if mtp is not None:  # the released layout: model.layers.{L+k}.*, num_nextn_predict_layers
        mtp_joint.save_released_mtp(mtp, model, mdir)
    with timer("eval_s"):
        L = config.num_hidden_layers
        mtp_prefixes = tuple(f"model.layers.{L + k}." for k in range(spec.mtp_layers))
        model = target_build.load_shipped(
            mdir, mtp_prefixes, attn_implementation=spec.attn_implementation
        )
        metrics, examples = target_build.score(
            model, tok, train_ex, test_ex, test_rows, a.gen_rows, stop_ids, spec.answer
        )
        load = (spec.expert_load or expert_load)(
            model, test_ex, tok.pad_token_id, spec.shape.num_experts_per_tok
        )

    report = target_build.write_report(
        out / f"build_log_{spec.family}.json",
        command="python -m drafttrain.zoo.build_moe "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        args=a,
        targs=targs,
        shape=spec.shape_dict(),
        n_params=n_params,
        rows={"train": len(train_rows), "test": len(test_rows)},
        tokens=target_build.token_counts(train_ex, test_ex),
        metrics=metrics,
        times=timer.times,
        threads=a.threads,
        examples=examples,
        log=log,
        losses=losses,
        expert_load=load,
    )
    print(json.dumps({"metrics": metrics, "times_s": timer.times}, indent=2), flush=True)
    return report


def main(argv=None) -> dict[str, dict]:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    return {f: build(TARGETS[f], a, argv) for f in a.family or sorted(TARGETS)}


if __name__ == "__main__":
    main()
