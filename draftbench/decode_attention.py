"""Benchmark the split-KV attention kernel (`draftkernels.decode_attention`) against SDPA over
the same cache (what `kv_cache.cached_attention` runs: the row's prefix read, the mask, the
default SDPA backend, cuDNN on an H100), the torch reference and `torch.compile(reference)`,
correctness first.

    python -m draftbench.decode_attention --out docs/results/$(date +%F)_h100_decode_attention.json
    python -m draftbench.decode_attention --plans 128:0,128:512 --lengths 1024   # split plans

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16): batch 1 and
8; T = 1 (a decode step), 4 (eagle3's verify at K = 3) and 8 (a dflash block); 512 to 8192
cached keys. Each time is one call replayed from a CUDA graph of 20 (how the captured round
runs it; no launch overhead), median of `triton.testing.do_bench`, in microseconds. Needs
CUDA; exits 0 with a message without it. `--plans P:C,...` also times the kernel under each
split plan (`TARGET_PROGRAMS` = P, `MIN_CHUNK` = C) on the same inputs, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from draftbench.timing import graph_ms, print_table

SHAPE = dict(nh=32, nkv=8, d=128)
BATCHES = (1, 8)
TS = (1, 4, 8)
LENGTHS = (512, 2048, 8192)


def make(B: int, T: int, L: int, device):
    """q, caches of `B + 1` rows (`rows` skips row 0) holding `L + T` keys, the mask of `T`
    slots at the end of the range."""
    from draftinfer.models.kv_cache import visibility_mask

    nh, nkv, d = SHAPE["nh"], SHAPE["nkv"], SHAPE["d"]
    g = torch.Generator(device=device).manual_seed(B * 1000 + T * 10 + L)
    kw = dict(device=device, dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, T, nh, d, **kw)
    kc = torch.randn(B + 1, L + T + 1, nkv, d, **kw)
    vc = torch.randn(B + 1, L + T + 1, nkv, d, **kw)
    rows = torch.arange(1, B + 1, device=device)
    cache_pos = (L - T + torch.arange(T, device=device))[None].expand(B, T)
    mask = visibility_mask(cache_pos, L, nh // nkv)
    return dict(q=q, k_cache=kc, v_cache=vc, rows=rows, mask=mask, attn_len=L)


def sdpa_over_cache(q, k_cache, v_cache, rows, mask, attn_len):
    """`cached_attention`'s attention after its write: prefix read, folded GQA, SDPA."""
    from draftinfer.models.kv_cache import read_rows

    B, T, nh, d = q.shape
    nkv = k_cache.shape[2]
    g = nh // nkv
    kc = read_rows(k_cache, rows, attn_len).transpose(1, 2)
    vc = read_rows(v_cache, rows, attn_len).transpose(1, 2)
    qf = q.view(B, T, nkv, g, d).permute(0, 2, 1, 3, 4).reshape(B, nkv, T * g, d)
    o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=mask)
    return o.view(B, nkv, T, g, d).permute(0, 2, 1, 3, 4).reshape(B, T, nh, d)


def plans_us(da, plans: list[tuple[int, int]], x: dict, want: torch.Tensor) -> dict:
    """The kernel's time under each split plan `(TARGET_PROGRAMS, MIN_CHUNK)` (us, same
    inputs, each checked against `want` first; the module's plan restored after), keyed
    `plan_<programs>_<min chunk>_us`."""
    keep = da.TARGET_PROGRAMS, da.MIN_CHUNK
    out = {}
    try:
        for programs, min_chunk in plans:
            da.TARGET_PROGRAMS, da.MIN_CHUNK = programs, min_chunk
            ns = da.split_plan(x["q"].shape[0] * x["k_cache"].shape[2], x["attn_len"])[1]
            err = (da.decode_attention(**x).float() - want).abs().max().item()
            if err > 2e-2:
                raise AssertionError(f"plan {programs}:{min_chunk} off by {err}")
            us = graph_ms(lambda: da.decode_attention(**x)) * 1e3
            out[f"plan_{programs}_{min_chunk}_us"] = us
            out[f"plan_{programs}_{min_chunk}_splits"] = ns
    finally:
        da.TARGET_PROGRAMS, da.MIN_CHUNK = keep
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--ts", default=",".join(map(str, TS)), help="query slots per row")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="cached keys")
    ap.add_argument(
        "--plans",
        default="",
        help="also time the kernel under these split plans, TARGET_PROGRAMS:MIN_CHUNK "
        "comma-separated (e.g. 128:0,128:512,128:4096)",
    )
    ap.add_argument(
        "--kernel-only", action="store_true", help="skip SDPA and the references (quick)"
    )
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_attention: CUDA is not available; nothing to benchmark.")
        return 0
    from draftkernels import decode_attention as da

    plans = [tuple(map(int, p.split(":"))) for p in a.plans.split(",") if p]
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731

    compiled_ref = torch.compile(da.decode_attention_ref)
    variants = {
        "kernel_us": da.decode_attention,
        "sdpa_us": sdpa_over_cache,
        "ref_us": da.decode_attention_ref,
        "compiled_us": compiled_ref,
    }
    if a.kernel_only:
        variants = {"kernel_us": da.decode_attention}
    rows, worst = [], 0.0
    for B in ints(a.batches):
        for T in ints(a.ts):
            for L in ints(a.lengths):
                x = make(B, T, L, "cuda")
                want = da.decode_attention_ref(**x).float()
                err = max((f(**x).float() - want).abs().max().item() for f in variants.values())
                worst = max(worst, err)
                if err > 2e-2:
                    print(f"MISMATCH at B={B} T={T} L={L}: {err}", file=sys.stderr)
                    return 1
                t = {name: graph_ms(lambda f=f, x=x: f(**x)) * 1e3 for name, f in variants.items()}
                rows.append(
                    {
                        "batch": B,
                        "T": T,
                        "L": L,
                        **t,
                        "x_sdpa": t.get("sdpa_us", float("nan")) / t["kernel_us"],
                        "x_compiled": t.get("compiled_us", float("nan")) / t["kernel_us"],
                        **plans_us(da, plans, x, want),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **SHAPE}
        a.out.write_text(json.dumps({**info, "max_abs_err": worst, "rows": rows}, indent=1) + "\n")
    print(f"correctness: every variant within {worst:.4f} of the fp32 reference (bf16 outputs)")
    cols = [
        ("batch", 5),
        ("T", 2),
        ("L", 5),
        ("kernel_us", 10),
        ("sdpa_us", 9),
        ("ref_us", 9),
        ("compiled_us", 11),
        ("x_sdpa", 7),
        ("x_compiled", 10),
        *[(f"plan_{p}_{c}_us", 14) for p, c in plans],
    ]
    print_table(rows, [c for c in cols if rows and c[0] in rows[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
