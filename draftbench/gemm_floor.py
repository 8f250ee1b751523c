"""The GEMMs of one training step, replayed alone: what the step's matrix products cost.

    calls = record(step)            # one step under torch.profiler (shapes, strides, dtypes)
    floor = replay(calls, device)   # those GEMMs again, back to back, nothing else

`record` runs `step()` once under `torch.profiler` with `record_shapes` and keeps every matrix
product the dispatcher saw (`aten::mm`, `aten::addmm`, `aten::bmm`, `aten::baddbmm`: eager
code, and inductor's compiled code, which calls them as extern kernels), each with its
operands' shapes, strides and dtypes from the profiler's trace. The strides matter: a weight
gradient's operand is a transposed view, and replayed row-major with an odd inner dimension
(2097 rows of the 8B draft head's chunk) cuBLAS ran it several times slower. `replay`
allocates one random operand of each recorded (shape, strides, dtype) and runs the step's
products again in the step's order, nothing between them, timed with CUDA events (the host
queues ahead, so the GPU runs them back to back): the step's GEMM time at cuBLAS's speed with
every other kernel (attention, norms, the loss's elementwise work, the optimizer) removed.
Within the step the same kernels ran up to ~7% faster on an H100 (operands warm in L2; session
19's profiles, docs/results.md), so it is a floor to within that: a bar whose time budget is
below the step's GEMMs cannot be met without doing less GEMM work
(`draftbench/train_step.py --gemm-floor`).

Not seen: products inside fused kernels that are not aten ops (cuDNN's and flash attention's,
a Triton kernel's `tl.dot`, inductor's Triton GEMM templates under `max_autotune`): a peer
whose loss is one fused Triton kernel would show a floor without its head.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

# aten op -> (operand positions of the two matrices, position of the added input or None)
OPS = {
    "aten::mm": ((0, 1), None),
    "aten::bmm": ((0, 1), None),
    "aten::addmm": ((1, 2), 0),
    "aten::baddbmm": ((1, 2), 0),
}
DTYPES = {
    "c10::BFloat16": torch.bfloat16,
    "c10::Half": torch.float16,
    "float": torch.float32,
    "double": torch.float64,
}


class Gemm(NamedTuple):
    """One recorded product: `op(*operands)`, operands as (shape, strides, dtype)."""

    op: str  # "aten::mm" ...
    operands: tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...]
    flops: int  # 2 M N K (times the batch)
    # written into its added input (`addmm(acc, a, b, out=acc)`: an in-place accumulation; the
    # trace shows an `out` operand of the added input's shape and dtype)
    in_place: bool = False

    @property
    def mnk(self) -> tuple[int, int, int, int]:
        """(batch, M, N, K) of the product."""
        (a, b), _ = OPS[self.op]
        sa, sb = self.operands[a][0], self.operands[b][0]
        batch = sa[0] if len(sa) == 3 else 1
        return batch, sa[-2], sb[-1], sa[-1]

    @property
    def layout(self) -> str:
        """Per matrix, N (row-major: last stride 1) or T (transposed)."""
        (a, b), _ = OPS[self.op]
        return "".join("N" if self.operands[i][1][-1] == 1 else "T" for i in (a, b))

    def label(self) -> str:
        batch, m, n, k = self.mnk
        head = f"{batch}x" if batch > 1 else ""
        dtype = self.operands[OPS[self.op][0][0]][2].removeprefix("c10::")
        name = self.op.removeprefix("aten::")
        return f"{name} {head}[{m},{k}]x[{k},{n}] {self.layout} {dtype}"


def _contiguous(shape) -> list[int]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.insert(0, acc)
        acc *= max(n, 1)
    return stride


def _operands(args: dict) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """A traced op's tensor operands as (shape, strides, dtype), scalars left out."""
    shapes, dtypes = args.get("Input Dims") or [], args.get("Input type") or []
    strides = args.get("Input Strides") or []
    out = []
    for i, shape in enumerate(shapes):
        dtype = dtypes[i] if i < len(dtypes) else ""
        if dtype not in DTYPES or not isinstance(shape, list):
            continue  # a scalar (beta, alpha), a tensor list, an unknown type
        stride = strides[i] if i < len(strides) and strides[i] else _contiguous(shape)
        out.append((tuple(shape), tuple(stride), dtype))
    return out


def record(step: Callable[[], object], device: torch.device | None = None) -> list[Gemm]:
    """The matrix products `step()` issues, in order (one call of it, under the profiler;
    operands from its trace's "Input Dims", "Input Strides" and "Input type")."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    calls = []
    for e in sorted(events, key=lambda e: e.get("ts", 0)):
        if e.get("cat") != "cpu_op" or e.get("name") not in OPS:
            continue
        (a, b), added = OPS[e["name"]]
        ops = _operands(e.get("args", {}))
        need = 2 if added is None else 3  # the matrices (and the added input); not `out=`
        if len(ops) < need:
            continue
        in_place = added is not None and len(ops) > need and ops[need] == ops[added]
        g = Gemm(e["name"], tuple(ops[:need]), 0, in_place)
        batch, m, n, k = g.mnk
        calls.append(g._replace(flops=2 * batch * m * n * k))
    return calls


def _tensor(shape, stride, dtype, device, gen) -> torch.Tensor:
    size = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
    flat = torch.randn(size, generator=gen, device="cpu", dtype=torch.float32)
    return flat.to(device=device, dtype=DTYPES[dtype]).as_strided(shape, stride)


def call_of(g: Gemm) -> Callable[..., torch.Tensor]:
    """The torch function that issues `g` again: an added input of another dtype than the
    matrices (an fp32 accumulator of bf16 products, `drafttrain.objectives.fused_ce._accumulate_mm`) is
    `addmm(..., out_dtype=)` (CUDA only, as the step that recorded it)."""
    fn = {
        "aten::mm": torch.mm,
        "aten::bmm": torch.bmm,
        "aten::addmm": torch.addmm,
        "aten::baddbmm": torch.baddbmm,
    }[g.op]
    (a, _), added = OPS[g.op]
    if added is not None and g.operands[added][2] != g.operands[a][2]:
        return partial(fn, out_dtype=DTYPES[g.operands[added][2]])
    return fn


def replay(calls: list[Gemm], device: torch.device, repeats: int = 3) -> dict[str, object]:
    """Time `calls` back to back on `device`: {"calls", "tflop", "floor_ms" (median of
    `repeats` passes of the whole list), "tflop_per_s", "by_shape": each distinct product,
    slowest first, {"gemm", "calls", "ms", "tflop"} from one more pass timed call by call}."""
    gen = torch.Generator().manual_seed(0)
    operands: dict[tuple, torch.Tensor] = {}

    def get(spec):
        if spec not in operands:
            operands[spec] = _tensor(*spec, device, gen)
        return operands[spec]

    work = []
    for g in calls:
        args = [get(spec) for spec in g.operands]
        fn = call_of(g)
        if g.in_place:  # accumulate into the added input, as the step did
            fn = partial(fn, out=args[OPS[g.op][1]])
        work.append((fn, args))
    cuda = device.type == "cuda"

    def now():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        import time

        return time.perf_counter()

    def ms(t0, t1) -> float:
        if cuda:
            t1.synchronize()
            return t0.elapsed_time(t1)
        return (t1 - t0) * 1e3

    for fn, args in work:  # warm: cuBLAS heuristics and workspaces
        fn(*args)
    passes = []
    for _ in range(max(1, repeats)):
        t0 = now()
        for fn, args in work:
            fn(*args)
        passes.append(ms(t0, now()))
    each: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for g, (fn, args) in zip(calls, work):
        t0 = now()
        fn(*args)
        entry = each[g.label()]
        entry[0] += 1
        entry[1] += ms(t0, now())
        entry[2] += g.flops
    floor = statistics.median(passes)
    tflop = sum(g.flops for g in calls) / 1e12
    by_shape = sorted(each.items(), key=lambda kv: -kv[1][1])
    return {
        "calls": len(calls),
        "tflop": tflop,
        "floor_ms": floor,
        "tflop_per_s": tflop / (floor / 1e3) if floor > 0 else None,
        "by_shape": [
            {"gemm": name, "calls": c, "ms": t, "tflop": f / 1e12} for name, (c, t, f) in by_shape
        ],
    }


def floor_of(step: Callable[[], object], device: torch.device, repeats: int = 3) -> dict:
    """`replay(record(step))`: one more step, then its GEMMs alone."""
    calls = record(step, device)
    out = replay(calls, device, repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def summary(f: dict) -> str:
    """One line of a floor."""
    rate = f.get("tflop_per_s")
    rate_s = f", {rate:.0f} TFLOP/s" if rate else ""
    head = f"GEMM floor {f['floor_ms']:.1f} ms"
    return f"{head} ({f['calls']} products, {f['tflop']:.1f} TFLOP{rate_s})"
