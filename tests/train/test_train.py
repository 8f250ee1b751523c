"""Training end to end on a tiny target: loss decreases and the export is complete (R4's
training half); exact resume after SIGKILL (R3); one-line errors for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftinfer.files.checkpoint import load_drafter
from drafttrain.jobs.errors import ConfigError, DataError
from drafttrain.jobs.job import run_job
from drafttrain.jobs.train import train
from drafttrain.trainer.loggers import read_metrics
from tests.support.presets import compose_preset, small_overrides

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_loss_decreases_and_exports(train_env, tmp_path):
    cfg = compose_preset("eagle3", small_overrides(train_env, tmp_path / "run", steps=30))
    summary = run_job(cfg)
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert rows[-1]["acc_0"] > rows[0]["acc_0"]
    assert rows[-1]["sim_al"] > 1.5
    exp = Path(summary["export_dir"])
    for name in (
        "config.json",
        "model.safetensors",
        "README.md",
        "training_args.yaml",
        "tokenizer.json",
        "speculators/config.json",
        "speculators/model.safetensors",
    ):
        assert (exp / name).is_file(), name
    assert not list(exp.glob("*.bin")) and not list(exp.glob("*.pt"))
    card = (exp / "README.md").read_text()
    assert card.startswith("---\nbase_model:") and "library_name: vllm" in card
    config = json.loads((exp / "config.json").read_text())
    assert config["drafttrain"]["ttt_steps"] == 3 and config["drafttrain"]["trained_steps"] == 30
    # The export equals the last checkpoint's tensors (bf16-rounded), through the loader.
    drafter, meta = load_drafter(exp, {"input_embeddings": torch.zeros(drafter_vocab(exp), 64)})
    ck = load_file(str(tmp_path / "run" / "checkpoints" / "step_000030" / "drafter.safetensors"))
    for name, t in drafter.trainable_state_dict().items():
        want = ck[name]
        want = want.to(torch.bfloat16).float() if want.is_floating_point() else want
        assert torch.equal(t, want), name
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 1000
    # The same export from the command line, into another directory, is identical.
    again = tmp_path / "again"
    r = subprocess.run(
        [sys.executable, "-m", "drafttrain.export", str(tmp_path / "run"), "--out", str(again)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-1000:]
    assert (again / "model.safetensors").read_bytes() == (exp / "model.safetensors").read_bytes()
    bad = subprocess.run(
        [sys.executable, "-m", "drafttrain.export", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert bad.returncode == 2 and "not a training run" in bad.stderr


def drafter_vocab(export: Path) -> int:
    return json.loads((export / "config.json").read_text())["vocab_size"]


def _cli(env, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "drafttrain",
        "conf=eagle3",
        *small_overrides(env, out),
        "export.enabled=false",
        # One intra-op thread: with two, torch 2.13.0+cpu computes `cos` on the worker
        # thread's half of a tensor with errors up to 1.5e-4 in about one process in five
        # (the target's RoPE), so two processes differ before any resume is involved.
        "trainer.num_threads=1",
        *extra,
    ]


@pytest.mark.slow
def test_resume_after_sigkill_is_exact(train_env, tmp_path):
    """R3: SIGKILL mid-run, restart with resume=true, final weights == uninterrupted run."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cli(train_env, full), check=True, cwd=REPO, capture_output=True, timeout=600)
    proc = subprocess.Popen(
        _cli(train_env, killed), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    marker = killed / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.read_text().strip() != "step_000030"  # really interrupted
    subprocess.run(
        _cli(train_env, killed, "resume=true"),
        check=True,
        cwd=REPO,
        capture_output=True,
        timeout=600,
    )
    a = load_file(str(full / "checkpoints" / "step_000030" / "drafter.safetensors"))
    b = load_file(str(killed / "checkpoints" / "step_000030" / "drafter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_error_drafter_size_does_not_fit_target(train_env, tmp_path):
    cfg = compose_preset(
        "eagle3", small_overrides(train_env, tmp_path) + ["drafter.hidden_size=48"]
    )
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert "hidden_size 48 does not fit target hidden_size 64" in _one_line(e)


def test_error_draft_vocab_larger_than_target(train_env, tmp_path):
    cfg = compose_preset(
        "eagle3", small_overrides(train_env, tmp_path) + ["drafter.draft_vocab_size=100000"]
    )
    with pytest.raises((ConfigError, DataError)) as e:
        train(cfg)
    assert "draft_vocab_size" in _one_line(e) or "draft vocab" in _one_line(e)


def test_error_dataset_without_assistant_turns(train_env, tmp_path):
    data = tmp_path / "no_assistant.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = compose_preset("eagle3", small_overrides(train_env, tmp_path) + [f"data.path={data}"])
    with pytest.raises(DataError) as e:
        train(cfg)
    assert "assistant" in _one_line(e)


def test_cli_error_is_one_line(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "drafttrain",
            "conf=eagle3",
            "target.name_or_path=/no/such/model",
            f"output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == [
        "error: target not found: '/no/such/model' is neither a local directory "
        "nor a hub id (org/name)"
    ]
