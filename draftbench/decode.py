"""Plain greedy decode throughput: native target (eager, and a compiled one-token step) vs
Hugging Face `generate`, on the same random-init Llama-shaped checkpoint, after a check that
both produce the same greedy tokens.

    python -m draftbench.decode --out bench_decode.json            # CUDA, ~0.9B, bf16
    python -m draftbench.decode --device cpu --tiny --out /tmp/b.json   # smoke test

Tokens/s = batch * new_tokens / wall time of one whole generate call (prefill of
`--prompt-len` tokens included), median of `--repeats` after a warm-up, CUDA-synchronised.
The model is random-init (no trained weights needed); in bf16 its near-flat logits make
HF and native greedy paths diverge early, so the check reports the first divergence and the
reference's top-2 logit margin there instead of failing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from draftinfer.decoding.baseline import greedy_generate
from draftinfer.files.loading import load_native_target

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="bf16 on cuda, fp32 on cpu"
    )
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke test)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled native step")
    p.add_argument("--no-hf-dynamic", action="store_true", help="skip HF with its default cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_decode.json"))
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads = 64, 2, 4, 2
        args.intermediate, args.vocab = 128, 512
        args.batch_sizes, args.prompt_len, args.new_tokens = "1,4", 8, 16
        args.repeats, args.check_prompts, args.check_tokens = 1, 2, 8
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    return args


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=None,  # never stop early: every run decodes exactly new_tokens
        pad_token_id=0,
    )


def describe(cfg) -> dict:
    keys = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ]
    return {k: getattr(cfg, k) for k in keys} | {"rope": "llama3", "tied": False}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> tuple[float, object]:
    """Median wall seconds of `repeats` calls (after one warm-up call) and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def rand_prompts(n: int, length: int | list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = length if isinstance(length, list) else [length] * n
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


@torch.no_grad()
def hf_generate(hf, prompts, new_tokens, device, cache: str | None, scores: bool = False):
    """Left-padded batch greedy generate; returns (new tokens per row, scores or None)."""
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=device)
    kw = {"cache_implementation": cache} if cache else {}
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=scores,
        output_scores=scores,
        **kw,
    )
    seqs = out.sequences if scores else out
    return seqs[:, T:].tolist(), (torch.stack(out.scores, 1).float() if scores else None)


def check_agreement(hf, native, args, device) -> list[dict]:
    """Per prompt (solo HF runs: no padding in the reference), first position where native
    greedy differs from HF greedy, and HF's top-2 logit margin there."""
    lens = [max(1, args.prompt_len // 2 + 7 * i) for i in range(args.check_prompts)]
    prompts = rand_prompts(len(lens), lens, args.vocab, args.seed + 1)
    ours = greedy_generate(native, prompts, args.check_tokens, [])
    rows = []
    for p, mine in zip(prompts, ours):
        ref, sc = hf_generate(hf, [p], args.check_tokens, device, None, scores=True)
        ref = ref[0]
        div = next((i for i, (a, b) in enumerate(zip(ref, mine)) if a != b), None)
        row = {"prompt_len": len(p), "tokens": len(ref), "first_divergence": div}
        if div is not None:
            top2 = sc[0, div].topk(2).values
            row["hf_top2_margin_at_divergence"] = round(float(top2[0] - top2[1]), 5)
        rows.append(row)
    return rows


def compiled_step(native, max_seq_len: int):
    """torch.compile(mode="reduce-overhead") of the one-token decode step, applied from
    outside the model (STYLE rule 3): fixed `attn_len` makes shapes static and sync-free."""
    for layer in native.model.layers:  # the KV cache is mutated in place between replays
        torch._dynamo.mark_static_address(layer.self_attn.k_cache)
        torch._dynamo.mark_static_address(layer.self_attn.v_cache)

    def step(ids, pos, rows, attn_len=None):  # a `StepFn`: its attention length is fixed
        return native(ids, pos, rows, attn_len=max_seq_len)[0]

    return torch.compile(step, mode="reduce-overhead", dynamic=False, fullgraph=True)


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_decode: CUDA is not available; run with --device cpu --tiny for a smoke test")
        return 0
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    cfg = model_config(args)
    env = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
    }
    result: dict = {"config": describe(cfg), "env": env, "args": {}}
    result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    max_seq_len = max(args.prompt_len, args.prompt_len // 2 + 7 * args.check_prompts)
    max_seq_len += max(args.new_tokens, args.check_tokens) + 8

    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        with torch.device(device):
            ref = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        n_params = sum(p.numel() for p in ref.parameters())
        result["config"]["params"] = n_params
        print(f"model: Llama-shaped random init, {n_params / 1e9:.3f}B params: {describe(cfg)}")
        ref.save_pretrained(tmp)
        del ref
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa")
        hf = hf.to(device).eval()
        native = load_native_target(tmp, device, dtype, max(args.batch_sizes), max_seq_len)

    agree = check_agreement(hf, native, args, device)
    result["agreement"] = agree
    write_json(args.out, result)
    for row in agree:
        print(f"agreement: {row}")

    runners = {"native_eager": None}
    if not args.no_compile:
        if device.type == "cuda":
            runners["native_compiled"] = "compile"
        else:
            result["native_compiled_skipped"] = "reduce-overhead (CUDA graphs) needs CUDA"
    runners["hf_static"] = "static"
    if not args.no_hf_dynamic:
        runners["hf_dynamic"] = None
    step = None
    rows: list[dict] = []
    for bs in args.batch_sizes:
        prompts = rand_prompts(bs, args.prompt_len, args.vocab, args.seed + 100 + bs)
        for name, how in runners.items():
            row = {"runner": name, "batch": bs, "new_tokens": args.new_tokens}
            try:
                if name.startswith("native"):
                    if how == "compile" and step is None:
                        step = compiled_step(native, max_seq_len)
                    fn_step = step if how == "compile" else None

                    def fn(prompts=prompts, fn_step=fn_step):
                        return greedy_generate(
                            native, prompts, args.new_tokens, [], step_fn=fn_step
                        )

                else:

                    def fn(prompts=prompts, how=how):
                        return hf_generate(hf, prompts, args.new_tokens, device, how)[0]

                sec, out = timed(fn, device, args.repeats)
                assert all(len(o) == args.new_tokens for o in out), "short output"
                row["seconds"] = round(sec, 4)
                row["tokens_per_s"] = round(bs * args.new_tokens / sec, 1)
            except Exception as e:  # a benchmark variant failing is a result, not a crash
                row["error"] = (
                    f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                )
                if name == "native_compiled":
                    traceback.print_exc(limit=3)
            rows.append(row)
            print(f"  {row}", flush=True)
            result["throughput"] = rows
            write_json(args.out, result)  # after every row: a killed run keeps what it measured

    names = list(runners)
    print(f"\nwrote {args.out}")
    print(
        f"greedy decode tokens/s ({args.dtype}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, median of {args.repeats}; {env['device']})"
    )
    print(f"{'batch':>6} " + " ".join(f"{n:>16}" for n in names))
    for bs in args.batch_sizes:
        cells = []
        for n in names:
            r = next(r for r in rows if r["runner"] == n and r["batch"] == bs)
            cells.append(f"{r['tokens_per_s']:>16.1f}" if "tokens_per_s" in r else f"{'error':>16}")
        print(f"{bs:>6} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
