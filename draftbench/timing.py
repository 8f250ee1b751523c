"""Timing and reporting helpers shared by the benchmarks: CUDA-event medians, CUDA-graph
replay, the kernel / reference / `torch.compile(reference)` triple, and the printed table."""

from __future__ import annotations


def print_table(rows: list[dict], cols: list[tuple[str, int]]) -> None:
    """Right-aligned columns (name, width); floats with one decimal."""
    print(" ".join(f"{name:>{w}}" for name, w in cols))
    for r in rows:
        cells = []
        for name, w in cols:
            v = r[name]
            cells.append(f"{v:>{w}.1f}" if isinstance(v, float) else f"{v!s:>{w}}")
        print(" ".join(cells))


def median_ms(fn) -> float:
    """Median milliseconds of `fn()` by `triton.testing.do_bench` (CUDA events)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def captured(fn, calls: int = 1):
    """A CUDA graph of `calls` back-to-back `fn()` (run once and once more on a side stream
    first, to compile and allocate outside the capture). `fn` must not sync with the host."""
    import torch

    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_ms(fn, calls: int = 20) -> float:
    """Median milliseconds of one `fn()` replayed from a CUDA graph of `calls` back-to-back
    calls (the device time of its kernels without Python launch overhead: how the engine runs
    it, inside the captured round). `fn` must be capturable (no host sync)."""
    return median_ms(captured(fn, calls).replay) / calls


def same_outputs(a, b) -> bool:
    """Tuples of tensors equal element for element."""
    import torch

    return all(torch.equal(x, y) for x, y in zip(a, b))


def time_three(kernel, ref, compiled, inputs: dict, want, timer=median_ms):
    """Times kernel, reference and (when given) `torch.compile(reference)` on `inputs`.

    Returns (timings dict in µs with speed ratios and `compiled_matches_ref`, the compiled
    function or None). An inductor failure is reported and drops the compiled variant for the
    rest of the run, so it never hides the kernel's numbers."""
    kernel_ms = timer(lambda: kernel(**inputs))
    ref_ms = timer(lambda: ref(**inputs))
    compiled_ms, match = float("nan"), ""
    if compiled is not None:
        try:
            got = compiled(**inputs)
        except Exception as e:
            print(f"torch.compile(reference) failed, skipping it: {type(e).__name__}: {e}")
            compiled = None
        else:
            match = same_outputs(got, want)
            compiled_ms = timer(lambda: compiled(**inputs))
    return {
        "kernel_us": kernel_ms * 1e3,
        "ref_us": ref_ms * 1e3,
        "compiled_us": compiled_ms * 1e3,
        "x_ref": ref_ms / kernel_ms,
        "x_compiled": compiled_ms / kernel_ms,
        "compiled_matches_ref": match,
    }, compiled
