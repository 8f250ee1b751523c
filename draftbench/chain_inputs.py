"""Benchmark the chain-drafter input preparation: Triton kernel vs torch reference vs
`torch.compile(reference)`, correctness first.

    python -m draftbench.chain_inputs --out docs/results/$(date +%F)_h200_chain_inputs.json

Batches 1..256 requests, K 1..8 (the [B, K+1] verify round); times are medians of
`triton.testing.do_bench` in microseconds. Needs CUDA; exits 0 with a message without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftbench.timing import print_table

BATCHES = (1, 8, 64, 256)
KS = (1, 4, 8)


def make(B: int, K: int, device):
    g = torch.Generator(device=device).manual_seed(B * 10 + K)
    acc = torch.randint(0, K + 1, (B,), generator=g, device=device)
    out = torch.randint(0, 128000, (B, K + 1), generator=g, device=device)
    out = torch.where(torch.arange(K + 1, device=device)[None] <= acc[:, None], out, -1)
    lens = torch.randint(2, 4000, (B,), generator=g, device=device)
    return out.contiguous(), acc.contiguous(), lens.contiguous()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_chain_inputs: CUDA is not available; nothing to benchmark.")
        return 0
    import triton
    from draftkernels import chain_inputs as ci

    compiled = torch.compile(ci.prepare_chain_inputs_ref)
    rows = []
    for B in BATCHES:
        for K in KS:
            args = make(B, K, "cuda")
            want = ci.prepare_chain_inputs_ref(*args)
            got = ci.prepare_chain_inputs(*args)
            if not all(torch.equal(x, y) for x, y in zip(got, want)):
                print(f"MISMATCH at B={B} K={K}", file=sys.stderr)
                return 1
            t = {
                name: triton.testing.do_bench(lambda f=f, a=args: f(*a), return_mode="median") * 1e3
                for name, f in (
                    ("kernel_us", ci.prepare_chain_inputs),
                    ("ref_us", ci.prepare_chain_inputs_ref),
                    ("compiled_us", compiled),
                )
            }
            rows.append(
                {
                    "batch": B,
                    "K": K,
                    **t,
                    "x_ref": t["ref_us"] / t["kernel_us"],
                    "x_compiled": t["compiled_us"] / t["kernel_us"],
                }
            )
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n"
        )
    print("correctness: kernel == reference on every shape")
    print_table(
        rows,
        [
            ("batch", 5),
            ("K", 2),
            ("kernel_us", 10),
            ("ref_us", 10),
            ("compiled_us", 11),
            ("x_ref", 6),
            ("x_compiled", 10),
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
