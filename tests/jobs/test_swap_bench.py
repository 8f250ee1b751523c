"""`draftbench.swap` (the hot swap's cost in the round) runs tiny on the CPU: every kind swaps
through the runner's seam, nothing is recaptured, the tokens do not change. The lead runs it on
a GPU at 8B shapes, where the captured round's graphs are replayed around each swap."""

from __future__ import annotations

import json

import pytest

from draftbench import swap
from draftinfer.registry import registered_kinds

pytestmark = pytest.mark.usefixtures("one_thread")


def test_swap_benchmark_tiny_on_cpu(tmp_path):
    out = tmp_path / "swap.json"
    kinds = ",".join(registered_kinds())
    argv = ["--device", "cpu", "--tiny", "--rounds", "8", "--batch", "2", "--context", "16"]
    assert swap.main([*argv, "--swap-every", "2", "--kinds", kinds, "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["kind"] for r in results] == registered_kinds()
    for r in results:
        assert r["swaps"] >= 2, r
        assert r["tokens_identical"] and not r["recaptured"], r
        assert r["t_apply_ms"] is not None and r["update_bytes"] > 0
