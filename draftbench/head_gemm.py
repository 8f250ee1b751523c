"""The full-vocabulary head GEMM of a block drafter's round, `[N, H] @ [V, H]^T`, at the row
counts a round gives it (N = batch x K drafts), by the ways it can be called.

    python -m draftbench.head_gemm --out docs/results/$(date +%F)_h200_head_gemm.json

A dflash round scores all K slots of every request against the target's head at once
(Llama-3.1-8B: V = 128256, H = 4096, a 1.05 GB bf16 weight, 0.22 ms at the H200's copy
bandwidth). The profile of `draftbench.drafting --profile` at batch 8, K = 15 (N = 120) shows
cuBLAS choosing a 256 x 16 tile for it (one weight read per 16 rows, ~2 ms). This times, per
N, each variant as a CUDA graph (the round's conditions), checks the logits equal the plain
call's, and prints ms and the effective weight bandwidth:

- `linear`: `F.linear(x3d, W)` on the strided `[B, K, H]` slice, as the proposer calls it;
- `linear2d`: the slice made contiguous `[N, H]` first;
- `pad<m>`: rows padded up to a multiple of m (64, 128), the pad dropped after;
- `chunks<m>`: rows in chunks of at most m, one GEMM each (each re-reads the weight).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from draftbench.timing import graph_ms


def variants() -> dict:
    def linear(x, w):
        return F.linear(x, w)

    def linear2d(x, w):
        return F.linear(x.reshape(-1, x.shape[-1]).contiguous(), w)

    def pad(m):
        def fn(x, w):
            x2 = x.reshape(-1, x.shape[-1])
            n = x2.shape[0]
            rows = -(-n // m) * m
            return F.linear(F.pad(x2, (0, 0, 0, rows - n)), w)[:n]

        return fn

    def chunks(m):
        def fn(x, w):
            x2 = x.reshape(-1, x.shape[-1])
            return torch.cat([F.linear(c, w) for c in x2.split(m)])

        return fn

    return {
        "linear": linear,
        "linear2d": linear2d,
        "pad64": pad(64),
        "pad128": pad(128),
        "chunks16": chunks(16),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--shapes", default="1x3,1x7,1x15,8x3,8x7,8x15,16x7")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("head_gemm: CUDA is not available; nothing timed")
        return 0
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w = torch.randn(a.vocab, a.hidden, device=dev, dtype=dt) * 0.02
    gbytes = w.numel() * w.element_size() / 1e9
    rows, fns = [], variants()
    for shape in a.shapes.split(","):
        b, k = (int(x) for x in shape.split("x"))
        # The proposer's slice: slots 1..K of a [B, K + 1, H] block output (strided).
        x = torch.randn(b, k + 1, a.hidden, device=dev, dtype=dt)[:, 1:]
        want = F.linear(x, w).reshape(b * k, -1)
        row = {"batch": b, "k": k, "n": b * k}
        for name, fn in fns.items():
            got = fn(x, w).reshape(b * k, -1)
            ms = graph_ms(lambda fn=fn, x=x: fn(x, w))
            row[name] = round(ms, 4)
            row[f"{name}_gbps"] = round(gbytes / ms, 1)
            row[f"{name}_max_diff"] = float((got.float() - want.float()).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = list(fns)
    print(f"\nhead GEMM ms ({torch.cuda.get_device_name()}, V={a.vocab}, H={a.hidden}, bf16)")
    print("batch x K | N | " + " | ".join(names))
    for r in rows:
        print(f"{r['batch']} x {r['k']} | {r['n']} | " + " | ".join(f"{r[n]:.3f}" for n in names))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
