"""One training job of a preset run in a subprocess, timed, its output kept beside the run:
the cells of the comparison tables (`draftbench.loss_table`, `draftbench.block_table`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def run_preset(out: Path, run: Path, preset: str, overrides: list[str]) -> tuple[list[str], float]:
    """`python -m drafttrain conf=<preset> output_dir=<run> <overrides>`, one intra-op thread,
    no progress bar; its stdout and stderr go to `<out>/<run name>.log`. -> (the command, wall
    seconds); a failed job stops the table with its last line."""
    cmd = [
        sys.executable, "-m", "drafttrain", f"conf={preset}", f"output_dir={run}",
        "trainer.num_threads=1", "trainer.progress=false", *overrides,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (out / f"{run.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"{run.name} failed: {tail}")
    return cmd, wall


def table_cells(out: str | Path) -> tuple[Path, Path, list[dict]]:
    """A resumable table's folder (created), its `table.json` and the cells already in it
    (a rerun skips those) -> (folder, table path, cells)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "table.json"
    return out, path, json.loads(path.read_text()) if path.exists() else []
