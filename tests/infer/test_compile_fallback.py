"""`draftinfer.decoding.compiled.compiled` with combo kernels: a compile inductor cannot finish
with them is redone without them (a Qwen3-MoE verify forward on an H200 hit inductor's "Dynamic
shape on reduction dimension is not supported" in a combo kernel), once, with a warning."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.exc import InductorError

from draftinfer.decoding import compiled as compiled_mod


def _double(x):
    return 2 * x


def test_a_combo_kernel_compile_error_is_redone_without_combo_kernels(monkeypatch):
    seen = []

    def fake_compile(fn, **kw):
        combo = kw.get("options", {}).get("combo_kernels")
        seen.append(combo)

        def run(*args):
            if combo:
                raise InductorError(RuntimeError("Dynamic shape on reduction dimension"), "tb")
            return fn(*args)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(compiled_mod, "_COMPILED", {})
    f = compiled_mod.compiled(_double, dynamic=True, options={"combo_kernels": True})
    with pytest.warns(UserWarning, match="without them"):
        assert f(torch.ones(2)).tolist() == [2.0, 2.0]
    assert f(torch.ones(1)).tolist() == [2.0]  # no second warning, no third compile
    assert seen == [True, False]
    # Without combo kernels nothing is wrapped: the compile error is the caller's.
    g = compiled_mod.compiled(_double, dynamic=True, options={"combo_kernels": False})
    assert g(torch.ones(1)).tolist() == [2.0]
    assert not isinstance(g, compiled_mod.ComboFallback)


def test_a_second_failure_is_raised(monkeypatch):
    def fake_compile(fn, **kw):
        def run(*args):
            raise InductorError(RuntimeError("something else"), "tb")

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(compiled_mod, "_COMPILED", {})
    f = compiled_mod.compiled(_double, options={"combo_kernels": True})
    with pytest.warns(UserWarning), pytest.raises(InductorError):
        f(torch.ones(1))
