"""Shared test helpers: one tolerance policy per dtype, NaN-poisoned `torch.empty`, Triton mode.

Kernel tests import what they need:

    from tests.support.utils import assert_close, poison_empty  # noqa: F401  (poison_empty: fixture)

`poison_empty` makes every `torch.empty` / `torch.empty_like` in the test return memory filled
with a poison value (NaN for floats, -7 for integers, True for bools), so an output element a
kernel forgot to write shows up instead of passing by luck with zeroed memory.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch

# One tolerance policy per dtype (atol, rtol), used by every numerical comparison. fp32 allows
# a few ulps of reassociation (different reduction orders); low precision allows about one
# rounding of the storage format. Integer and bool tensors are compared exactly.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1.3e-6 * 4),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

POISON_INT = -7


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """`{"atol", "rtol"}` for comparing tensors of `dtype` (0, 0 for exact dtypes)."""
    if dtype not in TOLERANCES:
        return {"atol": 0.0, "rtol": 0.0}
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None):
    """`torch.testing.assert_close` with the policy of `dtype` (default: the lower precision of
    the two tensors); NaN positions must match."""
    if dtype is None:
        dtype = actual.dtype
        if expected.dtype.is_floating_point and actual.dtype.is_floating_point:
            if torch.finfo(expected.dtype).eps > torch.finfo(actual.dtype).eps:
                dtype = expected.dtype
    tol = tolerance(dtype)
    torch.testing.assert_close(
        actual, expected.to(actual.dtype), equal_nan=True, check_dtype=False, **tol
    )


def fill_poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    if t.dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return t.fill_(0xA5)
    return t.fill_(POISON_INT)


@contextlib.contextmanager
def poisoned_empty():
    """Within the block, `torch.empty` and `torch.empty_like` return poisoned memory.

    Dynamo's table of torch functions is built once, from the `torch` namespace as it is at
    its first use: built inside the block it would hold the wrappers, and a later compile in
    the same process would refuse the real `torch.empty_like` (a graph break). It is built
    here, before the swap."""
    import torch._dynamo.trace_rules as trace_rules

    trace_rules.get_torch_obj_rule_map()
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        return fill_poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return fill_poison(real_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


@pytest.fixture
def poison_empty():
    """Fixture form of `poisoned_empty` for kernel tests."""
    with poisoned_empty():
        yield


def enable_triton_interpreter() -> None:
    """Run Triton kernels on CPU: must happen before a module with `@triton.jit` is imported
    (triton picks the interpreter when the decorator runs). A no-op when CUDA is present."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def import_kernel_module(name: str):
    """Import a kernel module so that its `@triton.jit` kernels can run here: interpreted on a
    CPU-only machine (re-importing the module if it was imported before the interpreter was
    switched on), compiled on a CUDA machine."""
    enable_triton_interpreter()
    module = importlib.import_module(name)
    if not torch.cuda.is_available() and _has_compiled_kernels(module):
        module = importlib.reload(module)
    return module


def _has_compiled_kernels(module) -> bool:
    from triton.runtime.jit import JITFunction

    return any(isinstance(v, JITFunction) for v in vars(module).values())


def kernel_test_device() -> torch.device:
    """Where kernel tests run: CUDA (compiled kernels) when present, else CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
