"""Benchmark TTT's diagonal merge (`draftkernels.ttt_merge`): Triton kernels vs the torch
references vs `torch.compile(reference)`, forward and backward, correctness first.

    python -m draftbench.ttt_merge --out docs/results/$(date +%F)_h200_ttt_merge.json

Shapes: an EAGLE-3 drafter at Llama-3.1-8B size (32 query / 8 kv heads, head_dim 128) on one
sequence of 8192 tokens (`--tokens`), TTT steps 1..6 extra keys (`S`), bf16. Times are medians
of CUDA events in microseconds, with the bytes each pass must move and the bandwidth that
gives, and the kernel alone at 1, 2, 4 and 8 warps per program (`ttt_merge.NUM_WARPS`). Needs CUDA; exits 0 with a message without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftbench.timing import median_ms, print_table, time_three

NH, NKV, D = 32, 8, 128
WARPS = (1, 2, 4, 8)


def make(N: int, S: int, device="cuda", dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device=device).manual_seed(S)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    return {
        "q": r(N, NH, D),
        "out_c": r(N, NH, D),
        "lse_c": 2 * torch.randn(N, NH, generator=g, device=device),
        "ks": r(N, NKV, S, D),
        "vs": r(N, NKV, S, D),
        "scale": D**-0.5,
    }


def close(a, b) -> bool:
    return all(torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2) for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_ttt_merge: CUDA is not available; nothing to benchmark.")
        return 0
    from draftkernels import ttt_merge as tm

    fwd_c = torch.compile(tm.ttt_merge_ref, dynamic=True)
    bwd_c = torch.compile(tm.ttt_merge_backward_ref, dynamic=True)
    rows = []
    N = a.tokens
    for S in range(1, 7):
        x = make(N, S)
        want = tm.ttt_merge_ref(**x)
        if not close(tm.ttt_merge(**x), want):
            print(f"MISMATCH forward at S={S}", file=sys.stderr)
            return 1
        out, lse = want
        bx = {
            "dout": torch.randn_like(x["q"]),
            "out": out,
            "q": x["q"],
            "lse": lse,
            "ks": x["ks"],
            "vs": x["vs"],
            "dq_c": torch.randn_like(x["q"]),
            "scale": x["scale"],
        }
        bwant = tm.ttt_merge_backward_ref(**bx)
        if not close(tm.ttt_merge_backward(**bx), bwant):
            print(f"MISMATCH backward at S={S}", file=sys.stderr)
            return 1
        qb, kb = N * NH * D * 2, N * NKV * S * D * 2  # bytes of one [N, nh, D] / ks tensor
        moved = {"forward": 3 * qb + 2 * kb + N * NH * 8, "backward": 5 * qb + 4 * kb + N * NH * 4}
        for name, kernel, ref, comp, inputs, w in (
            ("forward", tm.ttt_merge, tm.ttt_merge_ref, fwd_c, x, want),
            ("backward", tm.ttt_merge_backward, tm.ttt_merge_backward_ref, bwd_c, bx, bwant),
        ):
            t, _ = time_three(kernel, ref, comp, inputs, w)
            t["compiled_matches_ref"] = bool(t["compiled_matches_ref"])
            gbps = moved[name] / (t["kernel_us"] * 1e3)
            warps = {}
            for w in WARPS:  # the kernel alone at each warp count (the module's is kept)
                tm.NUM_WARPS, kept = w, tm.NUM_WARPS
                warps[f"w{w}_us"] = median_ms(lambda k=kernel, i=inputs: k(**i)) * 1e3
                tm.NUM_WARPS = kept
            rows.append({"pass": name, "S": S, **t, "kernel_GBps": gbps, **warps})
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(), "tokens": N, "torch": torch.__version__}
        a.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print("correctness: kernel == reference (bf16 tolerance) on every shape")
    print_table(
        rows,
        [
            ("pass", 8),
            ("S", 2),
            ("kernel_us", 10),
            ("ref_us", 10),
            ("compiled_us", 12),
            ("x_ref", 6),
            ("x_compiled", 10),
            ("kernel_GBps", 12),
        ]
        + [(f"w{w}_us", 8) for w in WARPS],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
