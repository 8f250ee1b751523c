"""Benchmark the parallel-drafting layout: Triton kernel vs torch reference vs torch.compile(ref).

    python -m draftbench.parallel_layout --out outputs/bench/parallel_layout.json
    python -m draftbench.parallel_layout --quick --no-compile   # a few shapes, no inductor

Shapes: batch B in {1, 8, 64, 256}, K in {2, 4, 8} drafts per parallel forward, and query
width Q in {K + 1 (a decode round: up to K accepted drafts + the recovered or bonus token), 128 (a chunk
of prefill)}; `max_model_len` and the mask token id come from the target named by `--target`.
Every shape is first checked for correctness (kernel == reference, exactly); a mismatch stops
the run before anything is timed. Times are medians of `triton.testing.do_bench` (ms, printed
in microseconds). Rows are appended to the JSON list in `--out`; the table is printed last.
Needs CUDA: without it the script says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

from draftbench import timing

# --- shape registry: real targets' context limits and mask ids, serving batch sizes ----------
TARGETS = {
    # max_model_len = max_position_embeddings; the mask token is a reserved special token
    "llama3-8b": dict(max_model_len=8192, mask_token_id=128_255),
    "qwen3-8b": dict(max_model_len=40_960, mask_token_id=151_669),
}
BATCHES = (1, 8, 64, 256)
NUM_DRAFTS = (2, 4, 8)  # K
PREFILL_Q = 128
QUICK = dict(batches=(1, 256), num_drafts=(4,))


def query_widths(k: int) -> tuple[int, ...]:
    return (k + 1, PREFILL_Q)


def make_inputs(
    batch: int, q: int, k: int, target: str, device: str = "cuda", seed: int = 0
) -> dict:
    """A realistic round: ragged n_valid in [1, Q], one request in eight near max_model_len,
    one in four capped below K by the caller (max_tokens running out)."""
    spec = TARGETS[target]
    mml = spec["max_model_len"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_valid = torch.randint(1, q + 1, (batch,), generator=g)
    n_valid[0] = q  # the widest request has nothing rejected
    p_last = torch.randint(q, mml - k - 3, (batch,), generator=g)
    near = torch.rand(batch, generator=g) < 0.125
    near[0] = False  # ... and drafts all K
    p_last = torch.where(near, mml - 2 - torch.randint(0, k + 2, (batch,), generator=g), p_last)
    max_drafts = torch.where(
        torch.rand(batch, generator=g) < 0.25,
        torch.randint(0, k + 1, (batch,), generator=g),
        torch.full((batch,), k),
    )
    max_drafts[0] = k
    return dict(
        token_ids=torch.randint(0, spec["mask_token_id"], (batch, q), generator=g).to(device),
        n_valid=n_valid.to(torch.int32).to(device),
        pos_start=(p_last - n_valid + 1).to(device),
        max_drafts=max_drafts.to(device),
        k=k,
        mask_token_id=spec["mask_token_id"],
        max_model_len=mml,
    )


def shapes_for(quick: bool) -> list[tuple[int, int, int]]:
    grid = QUICK if quick else dict(batches=BATCHES, num_drafts=NUM_DRAFTS)
    return [
        (batch, q, k)
        for batch, k in itertools.product(grid["batches"], grid["num_drafts"])
        for q in query_widths(k)
    ]


def check_correctness(pl, shapes, target: str, device: str) -> str | None:
    """None when the kernel equals the reference on every shape, else the first mismatch."""
    for batch, q, k in shapes:
        inputs = make_inputs(batch, q, k, target, device)
        if not timing.same_outputs(pl.parallel_layout(**inputs), pl.parallel_layout_ref(**inputs)):
            return f"MISMATCH kernel vs reference at B={batch} Q={q} K={k}"
    return None


def bench_rows(pl, shapes, target: str, device: str, compiled_ref, timer=timing.median_ms) -> list:
    rows = []
    for batch, q, k in shapes:
        inputs = make_inputs(batch, q, k, target, device)
        want = pl.parallel_layout_ref(**inputs)
        t, compiled_ref = timing.time_three(
            pl.parallel_layout, pl.parallel_layout_ref, compiled_ref, inputs, want, timer
        )
        rows.append(
            dict(
                target=target,
                batch=batch,
                Q=q,
                K=k,
                drafts=round(float(want[4].float().mean()), 2),  # mean num_drafts per request
                **t,
            )
        )
        print(f"  B={batch} Q={q} K={k}: kernel {t['kernel_us']:.1f} us", flush=True)
    return rows


def append_json(path: Path, rows: list[dict]) -> None:
    """Append to the JSON list in `path` (created when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() and path.stat().st_size else []
    path.write_text(json.dumps(old + rows, indent=1) + "\n")


def print_table(rows: list[dict]) -> None:
    cols = [
        ("batch", 5), ("Q", 4), ("K", 2), ("drafts", 6), ("kernel_us", 10), ("ref_us", 10),
        ("compiled_us", 11), ("x_ref", 6), ("x_compiled", 10),
    ]  # fmt: skip
    timing.print_table(rows, cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("outputs/bench/parallel_layout.json"))
    ap.add_argument("--target", choices=sorted(TARGETS), default="llama3-8b")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_parallel_layout: CUDA is not available; nothing to benchmark.")
        return 0
    import triton
    from draftkernels import parallel_layout as pl

    shapes = shapes_for(args.quick)

    # Correctness first: nothing is timed unless the kernel matches the reference everywhere.
    problem = check_correctness(pl, shapes, args.target, "cuda")
    if problem:
        print(problem)
        return 1
    print(f"correctness: kernel == reference on {len(shapes)} shapes")

    compiled_ref = None
    if not args.no_compile:
        torch._dynamo.config.cache_size_limit = 64
        compiled_ref = torch.compile(pl.parallel_layout_ref, dynamic=True)
    rows = bench_rows(pl, shapes, args.target, "cuda", compiled_ref)
    env = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    rows = [{**r, **env} for r in rows]
    append_json(args.out, rows)
    print(f"\nappended {len(rows)} rows to {args.out}\n")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
