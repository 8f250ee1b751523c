"""Benchmark the skinny GEMM (`draftkernels.skinny_gemm`) against cuBLAS (`F.linear`, what the
runner ran before) and inductor's coordinate-descent-tuned reduction (what gpt-fast's compiled
step runs at one row: `torch.compile` of `F.linear` with `coordinate_descent_tuning`), at the
weight shapes of a Llama-3.1-8B decode step and its drafters, correctness first.

    python -m draftbench.skinny_gemm --out docs/results/$(date +%F)_h100_skinny_gemm.json
    python -m draftbench.skinny_gemm --sweep --out ...   # also time every config, print the table

Each time is one call with a cold L2: the graph cycles through copies of the weight (at least
256 MB in all; a decode step reads every weight once), replayed from a CUDA graph, median of seven
means of ten replays, microseconds; `GB/s` is the weight bytes over the kernel's time.
The `step` rows add up one decode step's GEMMs (32 layers of qkv, o, gate_up, down, and the
head). Without `--shapes`, the fused gate/up at each row count above one also runs with
SwiGLU's product as its epilogue against the GEMM then the product (`swiglu` in the JSON), and
q/k/v, gate/up and o with a decoder layer's norm or residual add inside the launch against a
compiled norm or add kernel beside the GEMM (`norms`). `--sweep` times every config of `CONFIGS` per (M class, shape) and prints the fastest
as a `TABLE` literal for `kernels/skinny_gemm.py`. Needs CUDA; exits 0 with a message without.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from draftbench.timing import print_table

# name -> (N, K): Llama-3.1-8B with fused q/k/v and gate/up (the runner's CUDA default), the
# unfused k/v, the fused k/v of a block drafter's context rows, EAGLE-3's fc over three taps
# and its 32k draft head, MTP's eh_proj.
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
    "kv": (1024, 4096),
    "kv2": (2048, 4096),
    "fc3": (4096, 12288),
    "draft_head": (32000, 4096),
    "eh_proj": (4096, 8192),
    # gpt-oss-20b (hidden 2880, 64 q heads and 8 k/v heads of 64, vocabulary 201088) and
    # Qwen3-30B-A3B (hidden 2048, 32 q heads and 4 k/v heads of 128, vocabulary 151936): the
    # MoE targets' fused q/k/v, o and head (their experts run in `draftkernels.moe_experts`).
    "oss_qkv": (5120, 2880),
    "oss_o": (2880, 4096),
    "oss_head": (201088, 2880),
    "q3moe_qkv": (5120, 2048),
    "q3moe_o": (2048, 4096),
    "q3moe_head": (151936, 2048),
}
STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "head": 1}
ROWS = (1, 4, 5, 8, 16)
COLD_BYTES = 256 << 20


def configs(m_cls) -> list[tuple[int, int, int, int]]:
    """The sweep's (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates of one M class."""
    out = []
    if m_cls == 1:
        for bn in (1, 2, 4):
            for bk in (1024, 2048, 4096):
                for w in (4, 8, 16):
                    per_thread = bn * bk // (32 * w)
                    if 8 <= per_thread <= 128:
                        out += [(bn, bk, w, s) for s in (1, 3)]
    else:
        for bn in (16, 32, 64):
            for bk in (64, 128, 256):
                for w in (4, 8):
                    if bn * bk // (32 * w) <= 128:
                        out += [(bn, bk, w, s) for s in (2, 3, 4)]
        # Swapped (y^T = W x^T: the weight tile is the MMA's 64- or 128-row side, which
        # Hopper's warpgroup MMA needs); stages limited by shared memory (~227 KB); and the
        # same with the tiles brought in by the tensor memory accelerator ("tma").
        for variant in (True, "tma"):
            for bn in (64, 128):
                for bk in (64, 128, 256):
                    for w in (4, 8):
                        for s in (2, 3, 4, 5, 6):
                            if (bn + 16) * bk * 2 * s <= 200 * 1024:
                                out.append((bn, bk, w, s, variant))
    return out


def weights(N: int, K: int, device) -> list[torch.Tensor]:
    n = max(2, math.ceil(COLD_BYTES / (N * K * 2)))
    g = torch.Generator(device=device).manual_seed(N + K)
    return [
        torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(n)
    ]


def cold_us(fn, x, ws) -> float:
    """Microseconds of one `fn(x, w)` over a cold L2 (cycles through `ws` in a CUDA graph)."""
    for w in ws:
        fn(x, w)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in ws:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    chunks = []
    for _ in range(7):  # median of 7 means of 10 replays (a replay is ~0.1 ms: quick)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        chunks.append(start.elapsed_time(end) / 10)
    return sorted(chunks)[3] * 1e3 / len(ws)


def swiglu_rows(sg, device, rows_m) -> list[dict]:
    """Llama-3.1-8B's fused gate/up with SwiGLU's product as the kernel's epilogue
    (`sg.swiglu`) against the kernel's GEMM then the product (`epilogue=False`: eager
    `silu` and `mul` here, one fused inductor kernel in a compiled step), cold L2, us."""
    N, K = SHAPES["gate_up"]
    ws = weights(N, K, device)
    out = []
    for M in rows_m:
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        want = sg.skinny_swiglu_ref(x, ws[0], None).float()
        err = (sg.swiglu(x, ws[0]).float() - want).abs().max().item()
        row = {
            "M": M,
            "max_rel_err": err / max(1.0, want.abs().max().item()),
            "epilogue_us": cold_us(lambda x, w: sg.swiglu(x, w), x, ws),
            "gemm_then_product_us": cold_us(lambda x, w: sg.swiglu(x, w, epilogue=False), x, ws),
        }
        out.append(row)
        print(json.dumps({"swiglu": "gate_up", **row}), flush=True)
    return out


def norm_rows(sg, device, rows_m) -> list[dict]:
    """A decoder layer's norms and residual adds inside the GEMMs against the kernels apart,
    cold L2, us: q/k/v (mode `rms`: the RMS normalisation in the GEMM, the norm's weight
    folded into W) against a compiled norm kernel then the GEMM; gate/up the same with
    SwiGLU's epilogue at 2+ rows; o (mode `add`: the residual as the epilogue) against the
    GEMM then a compiled add. Each row's error against the reference first."""
    norm = torch.compile(sg.rms_norm_ref)
    add = torch.compile(torch.add)
    out = []
    for name, mode in (("qkv", "rms"), ("gate_up", "rms"), ("o", "add")):
        N, K = SHAPES[name]
        ws = weights(N, K, device)
        for M in rows_m:
            sw = name == "gate_up" and M > 1  # one row: the GEMM (the product apart)
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16) * 3
            if mode == "rms":
                ref = sg.skinny_rms_swiglu_ref if sw else sg.skinny_rms_gemm_ref
                want = ref(x, 1e-5, ws[0], None).float()
                got = sg._launch(x, ws[0], None, swiglu=sw, eps=1e-5).float()
                fused = cold_us(
                    lambda x, w, sw=sw: sg._launch(x, w, None, swiglu=sw, eps=1e-5), x, ws
                )
                apart = cold_us(
                    lambda x, w, sw=sw: sg._launch(norm(x, None, 1e-5), w, None, swiglu=sw), x, ws
                )
            else:
                r = torch.randn(M, N, device=device, dtype=torch.bfloat16)
                want = sg.skinny_gemm_add_ref(x, ws[0], None, r).float()
                got = sg._launch(x, ws[0], None, residual=r).float()
                fused = cold_us(lambda x, w, r=r: sg._launch(x, w, None, residual=r), x, ws)
                apart = cold_us(lambda x, w, r=r: add(sg._launch(x, w, None), r), x, ws)
            row = {
                "shape": name,
                "mode": mode,
                "M": M,
                "max_rel_err": (got - want).abs().max().item() / max(1.0, want.abs().max().item()),
                "gemm_us": cold_us(lambda x, w, sw=sw: sg._launch(x, w, None, swiglu=sw), x, ws),
                "apart_us": apart,
                "fused_us": fused,
            }
            out.append(row)
            print(json.dumps({"norms": name, **row}), flush=True)
        del ws
    return out


def sweep(sg, device, classes=(1, "m16"), shapes=None) -> tuple[dict, list[dict]]:
    """Fastest config per (M class, shape) and every timing (a config that fails to compile
    or to match the reference is skipped)."""
    table, log = {}, []
    for m_cls, M in ((c, 1 if c == 1 else 5) for c in classes):
        cands = configs(m_cls)
        for name, (N, K) in SHAPES.items():
            if shapes and name not in shapes:
                continue
            ws = weights(N, K, device)
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            want = sg.skinny_gemm_ref(x, ws[0], None).float()
            best = {}
            for cfg in cands:
                try:
                    got = sg._launch(x, ws[0], None, cfg).float()
                except Exception as e:  # out of shared memory, registers
                    print(f"SKIP {m_cls} {name} {cfg}: {type(e).__name__}", file=sys.stderr)
                    continue
                if (got - want).abs().max().item() > 2e-2 * max(1.0, want.abs().max().item()):
                    print(f"MISMATCH {m_cls} {name} {cfg}", file=sys.stderr)
                    continue
                us = cold_us(lambda x, w, cfg=cfg: sg._launch(x, w, None, cfg), x, ws)
                log.append({"m_class": str(m_cls), "shape": name, "config": cfg, "us": us})
                fam = {(): "plain", (True,): "swap", ("tma",): "tma"}[tuple(cfg[4:5])]
                if fam not in best or us < best[fam][1]:
                    best[fam] = (cfg, us)
            win = min(best.values(), key=lambda b: b[1])
            table[(m_cls, N, K)] = win[0]
            seen = ", ".join(f"{f} {c} {u:.1f} us" for f, (c, u) in sorted(best.items()))
            print(f"sweep {m_cls} {name}: best {win[0]} {win[1]:.1f} us ({seen})", flush=True)
            del ws
    return table, log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sweep", action="store_true", help="time every config first (minutes)")
    ap.add_argument(
        "--sweep-classes", default="1,m16", help="the M classes --sweep times (1, m16 or both)"
    )
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="M values timed after")
    ap.add_argument("--shapes", default="", help="comma-separated names of SHAPES (default: all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_skinny_gemm: CUDA is not available; nothing to benchmark.")
        return 0
    import torch._inductor.config as inductor_config
    from draftkernels import skinny_gemm as sg

    dev = torch.device("cuda")
    rows_m = [int(m) for m in a.rows.split(",")]
    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per shape below
    swept, log = {}, []
    if a.sweep:
        classes = [1 if c == "1" else c for c in a.sweep_classes.split(",")]
        swept, log = sweep(sg, dev, classes, a.shapes.split(",") if a.shapes else None)
        sg.TABLE.update(swept)
        print("TABLE = {")
        for (m_cls, N, K), cfg in swept.items():
            print(f"    ({m_cls!r}, {N}, {K}): {cfg},")
        print("}")
    with inductor_config.patch(coordinate_descent_tuning=True):
        cdt = torch.compile(lambda x, w: F.linear(x, w), dynamic=False)

        rows, worst = [], 0.0
        for name, (N, K) in SHAPES.items():
            if a.shapes and name not in a.shapes.split(","):
                continue
            ws = weights(N, K, dev)
            for M in rows_m:
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                want = sg.skinny_gemm_ref(x, ws[0], None).float()
                scale = max(1.0, want.abs().max().item())
                err = (sg.skinny_gemm(x, ws[0], None).float() - want).abs().max().item() / scale
                worst = max(worst, err)
                if err > 2e-2:
                    print(f"MISMATCH {name} M={M}: {err}", file=sys.stderr)
                    return 1
                t = {
                    "kernel_us": cold_us(lambda x, w: sg.skinny_gemm(x, w, None), x, ws),
                    "cublas_us": cold_us(lambda x, w: F.linear(x, w), x, ws),
                    "cdt_us": cold_us(cdt, x, ws) if M == 1 and name in STEP else float("nan"),
                }
                rows.append(
                    {
                        "shape": name,
                        "N": N,
                        "K": K,
                        "M": M,
                        "config": str(sg.config(M, N, K)),
                        **t,
                        "GB/s": N * K * 2 / t["kernel_us"] / 1e3,
                        "x_cublas": t["cublas_us"] / t["kernel_us"],
                        "x_cdt": t["cdt_us"] / t["kernel_us"],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            del ws
    swiglu = swiglu_rows(sg, dev, [M for M in rows_m if M > 1]) if not a.shapes else []
    norms = norm_rows(sg, dev, rows_m) if not a.shapes else []
    for M in rows_m if all(name in {r["shape"] for r in rows} for name in STEP) else []:
        sel = [r for r in rows if r["M"] == M and r["shape"] in STEP]
        tot = {
            k: sum(STEP[r["shape"]] * r[k] for r in sel)
            for k in ("kernel_us", "cublas_us", "cdt_us")
        }
        byts = sum(STEP[r["shape"]] * r["N"] * r["K"] * 2 for r in sel)
        rows.append(
            {
                "shape": "step",
                "N": 0,
                "K": 0,
                "M": M,
                "config": "",
                **tot,
                "GB/s": byts / tot["kernel_us"] / 1e3,
                "x_cublas": tot["cublas_us"] / tot["kernel_us"],
                "x_cdt": tot["cdt_us"] / tot["kernel_us"],
            }
        )
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        table = {f"{k[0]}|{k[1]}|{k[2]}": v for k, v in swept.items()}
        a.out.write_text(
            json.dumps(
                {
                    **info,
                    "max_rel_err": worst,
                    "table": table,
                    "rows": rows,
                    "swiglu": swiglu,
                    "norms": norms,
                    "sweep": log,
                },
                indent=1,
            )
            + "\n"
        )
    print(f"correctness: the kernel within {worst:.4f} (relative to max |y|) of the fp32 reference")
    print_table(
        rows,
        [
            ("shape", 10),
            ("M", 3),
            ("config", 20),
            ("kernel_us", 10),
            ("cublas_us", 10),
            ("cdt_us", 8),
            ("GB/s", 7),
            ("x_cublas", 8),
            ("x_cdt", 6),
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
