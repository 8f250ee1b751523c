"""The runner's tensor-parallel target (`draftinfer.models.tensor_parallel`, `tp=N`): two gloo
ranks on the CPU against one process.

- The sharded target's logits and tapped features equal the whole target's (fp32) on prefill,
  decode and verify shapes, Llama (`zoo:llama-tiny`, GQA) and Qwen3 (q/k norms); each rank's KV
  cache holds half the KV heads; the compiled decode forward traces whole (fullgraph).
- The runner at `tp=2` with a trained drafter gives the single-process runner's tokens, token
  for token, at T=0, and accepts drafts; rank 0 alone writes the report.
- `torchrun --nproc-per-node 2 -m draftinfer tp=2`: one report, printed once, lossless.
- Refusals, one line each: a family without a plan, heads that do not split, `tp=2` outside
  torchrun, suites and fused projections under tp.

The multi-process tests are `slow` (each spawns two processes that import torch and load the
target: seconds to a minute on two shared cores).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draftinfer.evaluation.config import EvalConfig, InferConfig
from draftinfer.evaluation.ranks import join_ranks
from draftinfer.evaluation.run import check_infer_config
from draftinfer.files.errors import ConfigError
from draftinfer.files.paths import resolve_path
from draftinfer.models.tensor_parallel import (
    check_dense_split,
    parallelize_dense,
    tensor_parallel_plan,
)
from tests.support.tp_ranks import (
    decode_with_runner,
    read_ranks,
    spawn_ranks,
    target_numerics,
    write_decoded,
)

TP = 2
# fp32, two partial sums of a row-split GEMM added by the all-reduce instead of one GEMM's
# accumulation order: differences of a few ulps of the largest value, nothing more.
ATOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_sharded_target_equals_whole(which, tiny_qwen3_dir, tmp_path):
    target_dir = resolve_path("zoo:llama-tiny") if which == "llama" else tiny_qwen3_dir
    spawn_ranks(target_numerics, TP, str(target_dir), str(tmp_path), which == "llama")
    for rank, r in enumerate(read_ranks(tmp_path, TP)):
        print(f"{which} rank {rank}: {r}")
        assert r["kv_heads"] * TP == r["kv_heads_whole"]
        for shape in ("prefill", "decode", "verify"):
            assert r[shape]["logit_scale"] > 0.1  # logits, not zeros (random qwen3: ~0.8)
            assert r[shape]["logits"] < ATOL, (shape, r[shape])
            assert r[shape]["features"] < ATOL, (shape, r[shape])
        if which == "llama":
            assert r["compiled_decode"]["logits"] < ATOL
            assert r["compiled_decode"]["features"] < ATOL


def test_runner_tp2_matches_one_process(kind_env, tmp_path):
    export = kind_env("eagle3")["export"]
    fields = dict(
        drafter=str(export),
        target="zoo:llama-tiny",
        num_prompts=4,
        max_new_tokens=24,
        batch_size=4,
        k=3,
        max_model_len=384,
        progress=False,
        plot="none",
    )
    one = decode_with_runner(InferConfig(**fields))
    tp_dir = tmp_path / "tp"
    tp_dir.mkdir()
    report = tmp_path / "tp" / "report.json"
    # No process group made for them: the runner joins from torchrun's environment.
    tp_fields = {**fields, "tp": TP, "report": str(report)}
    spawn_ranks(write_decoded, TP, tp_fields, str(tp_dir), init=False)
    ranks = read_ranks(tp_dir, TP)
    accepted = sum(a for acc in one["accepted"] for a in acc)
    print(f"one process: {one['tokens']}; accepted {accepted}")
    print(
        "tp=2 reports:",
        [(r["report"]["acceptance_length"], r["report"]["lossless"]) for r in ranks],
    )
    for r in ranks:
        assert r["tokens"] == one["tokens"]  # token for token, T=0
        assert r["accepted"] == one["accepted"]
        assert r["report"]["lossless"] and r["report"]["extra"]["tp"] == TP
        assert r["report"]["acceptance_length"] > 1.5
    assert accepted > 0
    assert report.is_file()  # rank 0 wrote it, once (rank 1 writes nothing)
    assert sorted(p.name for p in tp_dir.iterdir()) == ["rank0.json", "rank1.json", "report.json"]


def test_tp_refusals_one_line(zoo_target):
    assert tensor_parallel_plan(zoo_target, 2) is parallelize_dense
    moe = type("Moe", (), {"family": "qwen3_moe", "config": zoo_target.config})()
    with pytest.raises(ConfigError, match="the qwen3_moe family .* has no tensor-parallel plan"):
        tensor_parallel_plan(moe, 2)  # MoE targets: expert parallel, not yet
    cfg = dataclasses.replace(zoo_target.config, num_kv_heads=3)
    with pytest.raises(ConfigError, match="num_key_value_heads 3 is not divisible by 2"):
        check_dense_split(cfg, 2)
    with pytest.raises(ConfigError, match="torchrun"):
        join_ranks(2, torch.device("cpu"))
    base = InferConfig(drafter="d", tp=2, compile=False)
    with pytest.raises(ConfigError, match="suites"):
        check_infer_config(dataclasses.replace(base, eval=EvalConfig(suites=["mt_bench"])))
    with pytest.raises(ConfigError, match="fuse_projections"):
        check_infer_config(dataclasses.replace(base, fuse_projections=True))
    with pytest.raises(ConfigError, match="tp must be >= 1"):
        check_infer_config(dataclasses.replace(base, tp=0))


def test_cli_under_torchrun(kind_env, tmp_path):
    """`torchrun --nproc-per-node 2 -m draftinfer tp=2 ...`: the entry point as a user runs it;
    one report (rank 0's), printed once, lossless, with drafts accepted."""
    import json
    import os
    import subprocess
    import sys

    from tests.support.tp_ranks import free_port

    export = kind_env("eagle3")["export"]
    report = tmp_path / "tp2.json"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(TP)),
        *("--master-port", str(free_port()), "-m", "draftinfer"),
        *(f"drafter={export}", "target=zoo:llama-tiny", f"tp={TP}", "num_prompts=2"),
        *("max_new_tokens=16", "batch_size=2", f"report={report}", "progress=false"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("acceptance length") == 1  # rank 0 prints
    r = json.loads(report.read_text())
    assert r["lossless"] and r["extra"]["tp"] == TP and r["acceptance_length"] > 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp2.json", "tp2.png"]
