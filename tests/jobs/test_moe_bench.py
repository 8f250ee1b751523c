"""The MoE benchmarks' CPU paths: `draftbench.moe_rounding` on the tiny gpt-oss shape in fp32
(every configuration's verify row 0 equals its one-token forward; the JSON names them all),
and `draftbench.moe_experts`, which needs CUDA, exiting 0 with its message on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_moe_rounding_runs_on_the_tiny_shape(tmp_path):
    out = tmp_path / "diag.json"
    cmd = [sys.executable, "-m", "draftbench.moe_rounding", "--tiny", "--device", "cpu"]
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    configs = [k for k in res if "/" in k]
    assert configs == ["old/sdpa", "old/split_kv", "kernel/sdpa", "kernel/split_kv"]
    for name in configs:
        r = res[name]
        assert r["max_abs_one_token_vs_verify_row0"] < 1e-5, name
        assert r["replays_same_bits"] and r["one_token_top"] == r["verify_row0_top"], name
    for path in ("kernel", "grouped", "gather"):  # fp32 on the CPU: every path is exact
        assert res[f"layer0_{path}_max_abs_vs_fp32"] < 1e-5 * max(1.0, res["layer0_ref_absmax"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it times the kernel")
def test_moe_experts_bench_needs_cuda_and_says_so():
    r = subprocess.run(
        [sys.executable, "-m", "draftbench.moe_experts", "--tokens", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "CUDA is not available" in r.stdout
