"""Benchmark the rejection sampler: Triton kernel vs torch reference vs torch.compile(reference).

    python scripts/bench_rejection_sampler.py --out outputs/bench/rejection_sampler.csv
    python scripts/bench_rejection_sampler.py --quick --no-compile   # a few shapes, no inductor

Every shape is first checked for correctness (kernel == reference, bit-exact); a mismatch
stops the run before anything is timed. Times are medians of `triton.testing.do_bench` (ms,
printed in microseconds). Rows are appended to `--out` (`.csv`, else JSON Lines); the table is
printed last. Needs CUDA: without it the script says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import math
import sys
from pathlib import Path

import benchlib
import torch
from benchlib import import_kernel

REPO = Path(__file__).resolve().parents[1]

# --- shape registry: real vocabularies, serving batch sizes, draft lengths -------------------
VOCABS = {
    "draft-32k": 32_000,  # EAGLE-3 draft vocabulary / Llama-2
    "llama3-8b": 128_256,
    "qwen3-8b": 151_936,  # Qwen3-8B and Qwen3-VL-8B
}
BATCHES = (1, 4, 16, 64)
NUM_DRAFTS = (1, 4, 8)  # K drafts per request
MODES = ("full_q", "one_hot_q", "greedy")  # random with drafter probs / greedy drafter / greedy
TUNE_BLOCK_V = (1024, 2048, 4096, 8192, 16384)
TUNE_NUM_WARPS = (4, 8, 16)
QUICK = dict(vocabs=("llama3-8b",), batches=(1, 64), num_drafts=(4,), modes=MODES)


def make_inputs(vocab: int, batch: int, k: int, mode: str, seed: int = 0) -> dict:
    """A realistic round: ragged counts in [1, K]; peaked target rows (top token ~0.7) and a
    drafter that agrees with the target's top token about 80% of the time."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    counts = torch.randint(1, k + 1, (batch,), generator=g, device=dev)
    counts[0] = k  # the widest request always has K drafts
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
    cu[1:] = counts.cumsum(0)
    n = int(cu[-1])
    rows = torch.arange(n, device=dev)
    base = 1.5 * torch.randn(n, vocab, generator=g, device=dev)
    top = torch.randint(0, vocab, (n,), generator=g, device=dev)
    spike = math.log(vocab) + 2.0  # puts ~0.7 of the target's mass on `top`
    logits = base.index_put((rows, top), base[rows, top] + spike)
    agree = torch.rand(n, generator=g, device=dev) < 0.8
    draft_top = torch.where(agree, top, torch.randint(0, vocab, (n,), generator=g, device=dev))
    draft_logits = base + 0.7 * torch.randn(n, vocab, generator=g, device=dev)
    draft_logits = draft_logits.index_put((rows, draft_top), draft_logits[rows, draft_top] + spike)
    target = torch.softmax(logits, dim=-1)
    draft = torch.softmax(draft_logits, dim=-1)
    if mode == "full_q":
        d = torch.multinomial(draft, 1, generator=g)[:, 0]
    else:
        d = draft_logits.argmax(-1)
    return dict(
        draft_token_ids=d,
        cu_num_draft=cu,
        draft_probs=draft if mode == "full_q" else None,
        target_probs=target,
        bonus_token_ids=torch.randint(0, vocab, (batch,), generator=g, device=dev),
        is_greedy=torch.full((batch,), mode == "greedy", device=dev),
        uniforms=1.0 - torch.rand(n, generator=g, device=dev),
        recovery_noise=torch.empty(batch, vocab, device=dev).exponential_(generator=g),
        max_num_draft=k,
    )


def tune(rs) -> None:
    """Time the kernel over (BLOCK_V, num_warps) on the largest vocabulary; prints a table."""
    vocab = max(VOCABS.values())
    configs = list(itertools.product(TUNE_BLOCK_V, TUNE_NUM_WARPS))
    default = rs._launch_config(vocab)
    print(f"tune: V={vocab}, default (BLOCK_V, num_warps) = {default}; times in us")
    print(f"{'shape':>22} " + " ".join(f"{f'{bv}/{nw}':>10}" for bv, nw in configs))
    real_config = rs._launch_config
    try:
        for batch, k, mode in itertools.product((1, 64), (4,), MODES):
            inputs = make_inputs(vocab, batch, k, mode)
            want = rs.rejection_sample_ref(**inputs)
            cells = []
            for bv, nw in configs:
                rs._launch_config = lambda v, bv=bv, nw=nw: (bv, nw)
                got = rs.rejection_sample(**inputs)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                cells.append(benchlib.median_ms(lambda: rs.rejection_sample(**inputs)) * 1e3)  # noqa: B023
            print(f"{f'B={batch} K={k} {mode}':>22} " + " ".join(f"{c:>10.1f}" for c in cells))
    finally:
        rs._launch_config = real_config


def append_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        new = not path.exists()
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
    else:
        with path.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def print_table(rows: list[dict]) -> None:
    cols = [
        ("vocab", 10), ("batch", 5), ("K", 2), ("mode", 9), ("accept", 6),
        ("kernel_us", 10), ("ref_us", 10), ("compiled_us", 11), ("x_ref", 6), ("x_compiled", 10),
    ]  # fmt: skip
    benchlib.print_table(rows, cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=REPO / "outputs/bench/rejection_sampler.csv")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    ap.add_argument("--tune", action="store_true", help="time (BLOCK_V, num_warps) choices only")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_rejection_sampler: CUDA is not available; nothing to benchmark.")
        return 0
    import triton

    rs = import_kernel("rejection_sampler")
    if args.tune:
        tune(rs)
        return 0
    compiled_ref = None
    if not args.no_compile:
        torch._dynamo.config.cache_size_limit = 64
        compiled_ref = torch.compile(rs.rejection_sample_ref, dynamic=True)

    grid = QUICK if args.quick else dict(vocabs=tuple(VOCABS), batches=BATCHES, num_drafts=NUM_DRAFTS, modes=MODES)  # fmt: skip
    shapes = list(itertools.product(grid["vocabs"], grid["batches"], grid["num_drafts"], grid["modes"]))  # fmt: skip

    # Correctness first: nothing is timed unless the kernel matches the reference everywhere.
    for vocab_name, batch, k, mode in shapes:
        inputs = make_inputs(VOCABS[vocab_name], batch, k, mode)
        got, want = rs.rejection_sample(**inputs), rs.rejection_sample_ref(**inputs)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            print(f"MISMATCH kernel vs reference at {vocab_name} B={batch} K={k} {mode}")
            return 1
    print(f"correctness: kernel == reference on {len(shapes)} shapes")

    env = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    rows = []
    for vocab_name, batch, k, mode in shapes:
        inputs = make_inputs(VOCABS[vocab_name], batch, k, mode)
        out, num_acc = rs.rejection_sample(**inputs)
        n = int(inputs["cu_num_draft"][-1])
        t, compiled_ref = benchlib.time_three(
            rs.rejection_sample, rs.rejection_sample_ref, compiled_ref, inputs, (out, num_acc)
        )
        rows.append(
            dict(
                vocab=vocab_name,
                V=VOCABS[vocab_name],
                batch=batch,
                K=k,
                mode=mode,
                accept=round(float(num_acc.sum()) / n, 3),
                **t,
                **env,
            )
        )
        print(f"  {vocab_name} B={batch} K={k} {mode}: kernel {t['kernel_us']:.1f} us", flush=True)

    append_rows(args.out, rows)
    print(f"\nappended {len(rows)} rows to {args.out}\n")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
