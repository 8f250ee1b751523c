"""Benchmark the routed-experts kernel (`draftkernels.moe_experts`) against what the runner ran
before it (compiled `experts_gather`, gpt-fast's `ConditionalFeedForward`, and compiled
`experts_grouped`, two `F.grouped_mm`) and against the bytes the call must read (the touched
experts' weights and biases over the copy bandwidth measured in this process), at the expert
shapes of gpt-oss-20b and Qwen3-30B-A3B, for a decode step (1 token) and verify passes (K + 1
tokens), correctness first.

    python -m draftbench.moe_experts --out docs/results/$(date +%F)_h200_moe_experts.json
    python -m draftbench.moe_experts --sweep ...   # also time configs, print the TABLE literal
    python -m draftbench.moe_experts --router ...  # the runner's router against torch.topk's

Each time is one call with a cold L2: the graph cycles through copies of the layer's experts
(a decode step reads each layer's once), replayed from a CUDA graph, median, microseconds.
`frac` is the floor over the time; at one token `kernel_other_path_us` times the kernel's
other one-token path (`ROW_INVARIANT` flipped). `--sweep` times candidate configs of each launch (the
gate/up launch with the down launch at its default, then the down launch with the best
gate/up) per (rows class, shape) and prints the fastest as a `TABLE` literal for
`kernels/moe_experts.py`. Needs CUDA; exits 0 with a message without.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftbench.decode_peer import copy_bandwidth
from draftbench.timing import captured, median_ms, print_table

# name -> expert shapes: hidden, intermediate, experts, top-k, gpt-oss layout (x @ W,
# interleaved gate/up, clamped SwiGLU, biases) or Qwen3-MoE's (x @ W.T, halves, SiLU).
SHAPES = {
    "gpt-oss-20b": dict(H=2880, I=2880, E=32, k=4, gpt_oss=True),
    "qwen3-30b-a3b": dict(H=2048, I=768, E=128, k=8, gpt_oss=False),
}
TOKENS = (1, 4, 9)  # `--tokens`
COPIES = 3  # layers cycled per graph: each over 1 GB, far past L2


def make_layer(shape: dict, device, seed: int):
    from draftinfer.models.moe import ClampedSwiGLU, Experts, SiluGLU

    H, inter, E, gpt_oss = shape["H"], shape["I"], shape["E"], shape["gpt_oss"]
    act = ClampedSwiGLU() if gpt_oss else SiluGLU()
    ex = Experts(E, H, inter, act, bias=gpt_oss, x_at_w=gpt_oss).to(device, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, device=device, generator=g) * 0.02)
    return ex


def route(N: int, E: int, k: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.softmax(torch.randn(N, k, generator=g), -1)
    return weights.to(device, torch.bfloat16), experts.to(device)


def touched_bytes(ex, experts: torch.Tensor) -> int:
    """Bytes a call must read: each touched expert's gate/up and down weights and biases."""
    per = sum(
        p[0].numel() * p.element_size()
        for p in (ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_bias, ex.down_proj_bias)
        if p is not None
    )
    return per * int(torch.unique(experts).numel())


def one_call(path: str, x, ex, w, e, compiled: dict, cfgs=None):
    """A no-argument call of `path` ("kernel" with `cfgs`, else a compiled `moe.EXPERTS`
    entry) on layer `ex` for the route (`w`, `e`)."""
    import draftkernels.moe_experts as mk

    a1, a2 = ex.mats()
    b1, b2 = ex.gate_up_proj_bias, ex.down_proj_bias
    if path == "kernel":
        spec = ex.act.kernel_spec()
        return lambda: mk._launch(x, w, e, a1, b1, a2, b2, True, *spec, cfgs=cfgs).sum(1)
    fn = compiled[path]
    return lambda: fn(x, w, e, a1, b1, a2, b2, ex.act)


def cold_us(fns) -> float:
    """Microseconds of one call, each of `fns` (one per layer copy) once per graph replay."""
    g = captured(lambda: [f() for f in fns])
    return median_ms(g.replay) * 1e3 / len(fns)


def configs(rows_cls, stage: str) -> list[tuple[int, int, int, int]]:
    """The sweep's (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates of one launch."""
    out = []
    if rows_cls == "m1":  # one token through MMA: few programs, so deeper and wider tiles too
        for bn in (16, 32, 64):
            for bk in (128, 256, 512):
                for w in (4, 8):
                    for st in (3, 4, 6):
                        acc = bn * (2 if stage == "glu" else 1)
                        if (16 + acc) * bk * 2 * st <= 200 * 1024:
                            out.append((bn, bk, w, st))
        return out
    for bn in (16, 32, 64):
        for bk in (32, 64, 128, 256):
            for w in (4, 8):
                acc = bn * (2 if stage == "glu" else 1)
                if rows_cls == 1:
                    if 16 <= acc * bk // (32 * w) <= 128:
                        out.append((bn, bk, w, 3))
                elif bk <= 128 and w == 4:
                    out.append((bn, bk, w, 3))
    return out


@torch.no_grad()
def bench_shape(
    name: str, shape: dict, device, sweep: bool, bw: float, tokens=TOKENS
) -> tuple[list, dict]:
    import draftkernels.moe_experts as mk

    from draftinfer.models import moe

    layers = [make_layer(shape, device, seed) for seed in range(COPIES)]
    rows, table = [], {}
    for N in tokens:
        x = torch.randn(N, shape["H"], device=device, dtype=torch.bfloat16)
        routes = [route(N, shape["E"], shape["k"], device, seed=N * 10 + i) for i in range(COPIES)]
        ex0, (w0, e0) = layers[0], routes[0]
        w1, w2 = ex0.mats()
        args0 = (x, w0, e0, w1, ex0.gate_up_proj_bias, w2, ex0.down_proj_bias, ex0.act)
        want = moe.experts_reference(
            *[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args0[:-1]],
            ex0.act,
        )
        got = moe.experts_kernel(*args0)
        scale = want.abs().max().item()
        err = (got.float() - want).abs().max().item() / max(scale, 1e-6)

        compiled = {p: torch.compile(moe.EXPERTS[p], dynamic=False) for p in ("gather", "grouped")}

        def calls(path, cfgs=None, x=x, routes=routes, compiled=compiled):
            return [
                one_call(path, x, ex, w, e, compiled, cfgs) for ex, (w, e) in zip(layers, routes)
            ]

        floor_us = (
            sum(touched_bytes(ex, e) for ex, (_, e) in zip(layers, routes)) / COPIES / bw * 1e6
        )
        row = {"shape": name, "N": N, "max_rel_err": err, "floor_us": floor_us}
        row["kernel_us"] = cold_us(calls("kernel"))
        if N == 1:  # one token through the multiply-accumulate path instead (not row-invariant)
            saved, mk.ROW_INVARIANT = mk.ROW_INVARIANT, not mk.ROW_INVARIANT
            row["kernel_other_path_us"] = cold_us(calls("kernel"))
            mk.ROW_INVARIANT = saved
        for p in ("gather", "grouped"):
            try:
                row[f"{p}_us"] = cold_us(calls(p))
            except Exception as exc:  # noqa: BLE001 -- a path a device does not take
                row[f"{p}_us"] = float("nan")
                row[f"{p}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        row["frac"] = floor_us / row["kernel_us"]
        row.setdefault("kernel_other_path_us", float("nan"))
        row["swept_us"] = float("nan")
        if sweep and N in (tokens[0], tokens[-1]):
            cls = mk.rows_class(N)
            H, inter = shape["H"], shape["I"]
            best = {}
            glu_default = mk.config("glu", N, inter, H)
            down_default = mk.config("down", N, H, inter)
            for stage in ("glu", "down"):
                times = []
                for cfg in configs(cls, stage):
                    cfgs = (cfg, down_default) if stage == "glu" else (best["glu"], cfg)
                    try:
                        times.append((cold_us(calls("kernel", cfgs)), cfg))
                    except Exception:  # noqa: BLE001 -- out of resources: not a candidate
                        continue
                best[stage] = (
                    min(times)[1] if times else (glu_default, down_default)[stage == "down"]
                )
                row[f"sweep_{stage}"] = [[round(t, 2), list(c)] for t, c in sorted(times)[:5]]
            row["swept_us"] = cold_us(calls("kernel", (best["glu"], best["down"])))
            table[("glu", cls, inter, H)] = best["glu"]
            table[("down", cls, H, inter)] = best["down"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, table


# Router shapes: hidden, experts, top-k, rule (0: gpt-oss's, with bias; 1: Qwen3-MoE's).
ROUTERS = {"gpt-oss-20b": (2880, 32, 4, 0), "qwen3-30b-a3b": (2048, 128, 8, 1)}
ROUTER_COPIES = 48  # one per layer of a step, cycled: the weights leave L2 between visits


@torch.no_grad()
def bench_router(name: str, device, tokens) -> list[dict]:
    """The runner's router (its projection by the skinny-GEMM kernel, the top k by
    `moe.topk_by_rank`) against the one before it (`F.linear`, `torch.topk`), both compiled,
    us a call, cold-ish (`ROUTER_COPIES` routers cycled), correctness first (same experts and
    weights; a tie between two experts' scores may pick another expert: counted)."""
    import draftkernels.skinny_gemm as skinny

    import draftinfer.models.moe as moe

    H, E, k, rule = ROUTERS[name]
    routers = []
    for i in range(ROUTER_COPIES):
        r = moe.TopKSoftmaxRouter(H, E, k) if rule == 0 else moe.SoftmaxTopKRouter(H, E, k, True)
        r = r.to(device, torch.bfloat16)
        g = torch.Generator(device=device).manual_seed(i)
        for p in r.parameters():
            p.copy_(torch.randn(p.shape, device=device, generator=g) * 0.02)
        routers.append(r)
    rows = []
    saved = moe.RANK_TOPK
    try:
        for N in tokens:
            x = torch.randn(N, H, device=device, dtype=torch.bfloat16)
            t, out = {}, {}
            for label, rank, lin in (("before", False, None), ("runner", True, skinny.linear)):
                moe.RANK_TOPK = rank
                for r in routers:
                    if lin is None:
                        r.__dict__.pop("linear", None)  # the class's F.linear
                    else:
                        r.linear = lin
                torch._dynamo.reset()
                fn = torch.compile(lambda r, x: r(x), dynamic=False)
                out[label] = [fn(r, x) for r in routers]
                t[label] = cold_us([lambda r=r, x=x, fn=fn: fn(r, x) for r in routers])
            pairs = list(zip(out["runner"], out["before"]))
            differ = sum(int((g[1] != w[1]).any(-1).sum()) for g, w in pairs)
            err = max((g[0].float() - w[0].float()).abs().max().item() for g, w in pairs)
            row = {"router": name, "N": N, "rows_other_experts": differ, "max_weight_err": err}
            row.update(before_us=t["before"], runner_us=t["runner"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        moe.RANK_TOPK = saved
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--router", action="store_true", help="time the routers only")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    tokens = tuple(int(t) for t in a.tokens.split(","))
    if not torch.cuda.is_available():
        print("moe_experts bench: CUDA is not available; nothing timed")
        return 0
    device = torch.device("cuda")
    if a.router:
        rows = []
        for name in a.shapes.split(","):
            rows += bench_router(name, device, tokens)
        cols = [("router", 14), ("N", 3), ("rows_other_experts", 19), ("before_us", 10)]
        print_table(rows, [*cols, ("runner_us", 10)])
        if a.out:
            Path(a.out).write_text(json.dumps({"router": rows}, indent=1))
        return 0
    bw = copy_bandwidth(device, 1 << 30)
    rows, table = [], {}
    for name in a.shapes.split(","):
        r, t = bench_shape(name, SHAPES[name], device, a.sweep, bw, tokens)
        rows += r
        table.update(t)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; cold L2, us per call")
    cols = [
        ("shape", 14),
        ("N", 3),
        ("floor_us", 9),
        ("kernel_us", 10),
        ("kernel_other_path_us", 21),
        ("gather_us", 10),
        ("grouped_us", 11),
        ("frac", 6),
    ]
    if a.sweep:
        cols.append(("swept_us", 9))
    print_table(rows, cols)
    if table:
        print("TABLE = {")
        for key, cfg in sorted(table.items(), key=str):
            print(f"    {key!r}: {cfg!r},")
        print("}")
    if a.out:
        meta = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "copy_bw_TBps": bw / 1e12,
        }
        res = {"meta": meta, "rows": rows, "table": {str(k): v for k, v in table.items()}}
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
