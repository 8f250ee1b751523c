"""CUDA-graph capture applied from outside the model code (STYLE rule 3): one module, used by
the engine for the whole speculative round (DESIGN section 7).

`GraphedFunction(fn)` wraps a function `fn(*tensors, *static) -> tuple[Tensor, ...]` whose
tensor work makes no host sync and whose shapes depend only on the static arguments (the
round: `(attn_len, all_greedy)` for a decoder of fixed `max_batch` and K). Per static key:

1. the first `warmup` calls run `fn` as is (they are real calls: their results are used);
   they compile whatever `torch.compile` wraps inside and allocate lazily built buffers;
2. the next call captures `fn` into a `torch.cuda.CUDAGraph`, on static copies of its tensor
   inputs, then replays it;
3. later calls copy the inputs into that graph's static inputs (skipped for a tensor that
   already is one) and replay.

A capture that fails (seen twice at real shapes on an H200, `cudaErrorStreamCaptureInvalidated`
at a Triton launch inside the capture: one kind's round at one K, a different kind and K in
another run of the same benchmark) leaves the persistent state as it
was, since a capture records kernels without running them. That call then runs `fn` eagerly
(a real call, which loads and tunes whatever the capture met first) with one warning, and
the next call of the key captures again; a second failure of the same key raises.

The outputs are the graph's own static tensors: valid until the next replay of the same
graph, so a caller that keeps one across calls (the engine keeps the next first pass) hands
it back in as an input, which is copied before the replay overwrites it. Everything else
`fn` reads or writes (KV caches, per-row sampling tensors, a target's M-RoPE deltas) must be
persistent tensors updated in place, which the engine's state is.

All graphs of one `GraphedFunction` share one memory pool: their intermediates are dead
between calls and every output a caller may still hold is referenced here, so a later
capture never reuses its memory. Replay is bit-exact with the eager call of the same compiled
kernels (test B4, `tests/gpu/test_gpu.py`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


class GraphedFunction:
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], warmup: int = 1):
        if warmup < 1:
            raise ValueError("warmup must be >= 1 (the first call compiles and allocates)")
        self.fn, self.warmup = fn, warmup
        self.graphs: dict[Hashable, _Captured] = {}
        self.calls: dict[Hashable, int] = {}
        self.replays = 0
        self.capture_retries: dict[Hashable, str] = {}  # key -> why its first capture failed
        self._pool = None

    def __call__(self, tensors: tuple[torch.Tensor, ...], *static: Hashable):
        key = static
        entry = self.graphs.get(key)
        if entry is None:
            n = self.calls.get(key, 0)
            if n < self.warmup:
                self.calls[key] = n + 1
                return self.fn(*tensors, *static)
            entry = self._capture_or_none(key, tensors, static)
            if entry is None:  # a failed capture ran nothing: this call runs eagerly
                return self.fn(*tensors, *static)
        for dst, src in zip(entry.inputs, tensors, strict=True):
            if dst is not src:
                if dst.shape != src.shape:  # a broadcasting copy would replay wrong rows
                    raise ValueError(
                        f"graph for {key} was captured with an input of shape "
                        f"{tuple(dst.shape)}, called with {tuple(src.shape)}: a shape that "
                        "varies must be part of the static key"
                    )
                dst.copy_(src)
        entry.graph.replay()
        self.replays += 1
        return entry.outputs

    def _capture_or_none(self, key, tensors, static) -> _Captured | None:
        """The key's graph, or None after its first failed capture (module docstring)."""
        try:
            return self._capture(key, tensors, static)
        except Exception as e:  # noqa: BLE001 (re-raised on the key's second failure)
            if key in self.capture_retries:
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.capture_retries[key] = why
            torch.cuda.synchronize()  # raises if the failure left the device unusable
            warnings.warn(
                f"CUDA-graph capture of {key} failed ({why}); this call runs uncaptured and "
                "the next one captures again",
                stacklevel=3,
            )
            return None

    def _capture(self, key, tensors, static) -> _Captured:
        # Static inputs keep the callers' (dense) strides: a guard of a compiled function
        # inside `fn` may depend on them, and a recompile during capture would fail.
        inputs = tuple(t.clone() for t in tensors)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = tuple(self.fn(*inputs, *static))
        if self._pool is None:
            self._pool = graph.pool()
        entry = _Captured(graph, inputs, outputs)
        self.graphs[key] = entry
        return entry
