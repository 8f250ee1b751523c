"""Data-parallel training on the CPU: two gloo processes under `torchrun` train exactly what
one process trains with the same global batch (per-step losses match), resume from a
checkpoint written by both ranks, and only rank 0 writes the run (DESIGN D1's loss-match
check, the part that runs without GPUs; the GPU runs are in docs/results.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafttrain.jobs.train import train
from drafttrain.trainer.distributed import shard_batch
from drafttrain.trainer.loggers import read_metrics
from tests.support.presets import compose_preset, small_overrides

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
GLOO_ABORT = "terminate called without an active exception"


def _overrides(env, out: Path) -> list[str]:
    return small_overrides(env, out, steps=STEPS) + [
        "trainer.log_every=1",
        "trainer.num_threads=1",
        "export.enabled=false",
    ]


def _torchrun(env, out: Path, *extra: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "-m",
        "drafttrain",
        "conf=eagle3",
        *_overrides(env, out),
        *extra,
    ]
    before = out.with_name(out.name + ".before")
    if out.exists():  # a resume: keep what the attempt starts from
        shutil.copytree(out, before)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and GLOO_ABORT in r.stderr:
        # Seen once, in a clean-clone CI run (2026-11-26): a rank aborted right after loading the
        # target, in gloo's C++ threads, before any step; the same run passed on every rerun.
        # One retry from the same starting state: a failure of the job itself fails both.
        print(f"torchrun: a rank aborted ({GLOO_ABORT!r}); retrying once", file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
        if before.exists():
            shutil.copytree(before, out)
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_shard_batch_rows_and_empty_rank():
    batch = {
        "input_ids": torch.arange(12).view(3, 4),
        "loss_mask": torch.ones(3, 4, dtype=torch.long),
        "index": torch.tensor([7, 8, 9]),
    }
    assert shard_batch(batch, 0, 2)["index"].tolist() == [7, 9]
    assert shard_batch(batch, 1, 2)["index"].tolist() == [8]
    lone = shard_batch(batch, 3, 4)  # no row left for rank 3: row 0, counting nothing
    assert lone["index"].tolist() == [7] and lone["loss_mask"].sum() == 0


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_and_resume(train_env, tmp_path):
    threads = torch.get_num_threads()
    one = train(compose_preset("eagle3", _overrides(train_env, tmp_path / "one")))["losses"]
    # trainer.num_threads=1 held for the run only: later tests in this process (golden
    # losses) depend on the thread count through CPU reduction order.
    assert torch.get_num_threads() == threads

    two = tmp_path / "two"
    _torchrun(train_env, two)
    rows = [r for r in read_metrics(two) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # rank 0 logged, once each
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[0]
    for step, (a, b) in enumerate(zip(losses, one), 1):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5), f"step {step}: 2 ranks {a} vs 1 {b}"
    state = json.loads((two / "checkpoints" / f"step_{STEPS:06d}" / "state.json").read_text())
    assert state["world_size"] == 2
    assert (two / "checkpoints" / f"step_{STEPS:06d}" / "rng_rank1.safetensors").is_file()

    # Resume: both ranks restart from the step-4 checkpoint (as after a kill there) and end
    # with the uninterrupted run's weights.
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    ckpts = resumed / "checkpoints"
    shutil.rmtree(ckpts / f"step_{STEPS:06d}")
    (ckpts / "latest").write_text("step_000004")
    (resumed / "metrics.jsonl").unlink()
    _torchrun(train_env, resumed, "resume=true")
    a = load_file(str(two / "checkpoints" / f"step_{STEPS:06d}" / "drafter.safetensors"))
    b = load_file(str(ckpts / f"step_{STEPS:06d}" / "drafter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_zero3_config_does_not_partition_the_target():
    """With a ZeRO-3 config registered, transformers would build the frozen target inside
    `deepspeed.zero.Init` (partitioned, through collectives); the trainer loads it whole."""
    from types import SimpleNamespace

    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    from drafttrain.trainer.distributed import replicated_loading

    plugin = DeepSpeedPlugin(
        hf_ds_config=str(REPO / "conf" / "launch" / "deepspeed" / "zero3.json")
    )
    plugin.set_deepspeed_weakref()
    try:
        assert is_deepspeed_zero3_enabled()
        with replicated_loading(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))):
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()


def test_deepspeed_on_cpu_is_a_one_line_error(train_env, tmp_path):
    from drafttrain.jobs.errors import ConfigError

    cfg = compose_preset(
        "eagle3",
        _overrides(train_env, tmp_path / "ds")
        + ["trainer.deepspeed=conf/launch/deepspeed/zero2.json"],
    )
    with pytest.raises(ConfigError, match="needs CUDA GPUs") as e:
        train(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "ds").exists()
