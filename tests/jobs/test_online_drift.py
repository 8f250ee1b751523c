"""The drift job (`conf=online_drift`, `drafttrain.online.drift`) on a tiny budget: the table and
the plot, versions published atomically with their manifest, every measurement lossless; killed
with SIGKILL after a version was published and started again, it ends with the uninterrupted
run's versions and table (nothing lost, nothing published twice). The full preset's numbers
are in docs/results.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafttrain.online.publish import read_manifest

TINY = [
    "online.base_steps=12",
    "online.target_steps=6",
    "online.segments=2",
    "online.steps_per_publish=6",
    "online.prompts=4",
    "online.train_prompts=16",
    "online.max_new_tokens=16",
    "online.target_tokens_per_batch=256",
    "data.max_samples=300",
    "data.batch_size=4",
    "trainer.progress=false",
    "trainer.log_every=5",
]


def command(out: Path) -> list[str]:
    return [sys.executable, "-m", "drafttrain", "conf=online_drift", f"output_dir={out}", *TINY]


def stable(rows: list[dict]) -> list[dict]:
    """The table without wall times."""
    return [
        {**r, "stale": {**r["stale"], "seconds": 0}, "online": {**r["online"], "seconds": 0}}
        for r in rows
    ]


@pytest.mark.slow
def test_online_drift_tiny_and_resume_after_sigkill(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    whole = tmp_path / "whole"
    subprocess.run(command(whole), check=True, env=env, capture_output=True, timeout=600)
    table = json.loads((whole / "al_over_time.json").read_text())["rows"]
    assert [r["time"] for r in table] == [0, 1, 2]
    assert all(r["stale"]["lossless"] and r["online"]["lossless"] for r in table)
    assert [r["online"]["version"] for r in table] == [0, 1, 2]  # hot-swapped in the runner
    assert all(r["stale"]["version"] == 0 for r in table)
    assert table[0]["stale"]["al"] == table[0]["online"]["al"]  # one drafter at t = 0
    assert (whole / "al_over_time.png").stat().st_size > 0
    m = read_manifest(whole / "versions")
    assert [v["version"] for v in m["versions"]] == [0, 1, 2] and m["latest"] == 2
    assert [v["steps"] for v in m["versions"]] == [12, 18, 24]
    assert [v["data_seen"] for v in m["versions"]] == [48, 72, 96]
    for v in m["versions"]:  # weights only: the export's drafter files, nothing else
        files = sorted(p.name for p in (whole / "versions" / v["dir"]).iterdir())
        assert files == ["config.json", "model.safetensors"]

    # Killed after version 1 is published (the trainer has run a quota since the start).
    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        command(cut), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 600
        while read_manifest(cut / "versions")["latest"] < 1:
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert read_manifest(cut / "versions")["latest"] == 1
    assert not (cut / "al_over_time.png").exists()
    subprocess.run(command(cut), check=True, env=env, capture_output=True, timeout=600)
    resumed = json.loads((cut / "al_over_time.json").read_text())["rows"]
    assert stable(resumed) == stable(table)
    m2 = read_manifest(cut / "versions")
    strip = [
        {k: v[k] for k in ("version", "steps", "data_seen", "target_step")} for v in m2["versions"]
    ]
    assert strip == [
        {k: v[k] for k in ("version", "steps", "data_seen", "target_step")} for v in m["versions"]
    ]
