"""Atomic, versioned, weights-only publishing of a drafter, and the runner side that follows it.

Layout of a publishing root (`ROOT`):

    ROOT/manifest.json            {"format": 1, "latest": N, "versions": [{version, steps,
                                   data_seen, dir, published_at, ...}, ...]}
    ROOT/v000000/                 config.json + model.safetensors (the export's own format)
    ROOT/v000001/ ...

A version directory holds exactly what an export's drafter files hold (`write_drafter`: the
kind's serving `config.json` and tensor names), nothing else: it is the update an engine's
weight-update call takes (`draftinfer.decoding.swap.DrafterUpdate.from_export`). Publishing is
atomic in two renames: the version is written to `vNNNNNN.tmp/` and renamed, then the manifest
is rewritten to a temporary file and renamed over the old one. A reader that sees version N in
the manifest finds its directory complete; a crash leaves at most a `.tmp` directory, which
the next publish of that version replaces. Versions only grow: a publisher that restarts
continues from the manifest's `latest` (`next_version`), and a publish of a run step already
published is a no-op (`publish_checkpoint` returns the existing version).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from draftinfer.decoding.swap import DrafterUpdate
from draftinfer.files.checkpoint import atomic_write_text, write_drafter
from drafttrain.jobs.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = 1


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of `root`; an empty one (`latest` -1) when nothing was published."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return {"format": FORMAT, "latest": -1, "versions": []}
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupted {path}: {e}") from None
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {m.get('format')!r}, this code reads {FORMAT}")
    return m


def next_version(root: str | Path) -> int:
    return int(read_manifest(root)["latest"]) + 1


def publish(
    root: str | Path,
    drafter: torch.nn.Module,
    meta: dict[str, Any],
    steps: int,
    data_seen: int,
    dtype: torch.dtype = torch.bfloat16,
    extra: dict[str, Any] | None = None,
) -> int:
    """Publish `drafter`'s weights as the next version of `root` (atomically, module
    docstring); `steps` (optimizer steps so far) and `data_seen` (training sequences so far) go
    into the manifest with `extra`. Returns the version."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    m = read_manifest(root)
    version = int(m["latest"]) + 1
    final = version_dir(root, version)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_drafter(tmp, drafter, {**meta, "version": version}, dtype)
    if final.exists():  # a crash after the rename, before the manifest: not yet published
        shutil.rmtree(final)
    tmp.rename(final)
    entry = {
        "version": version,
        "steps": int(steps),
        "data_seen": int(data_seen),
        "dir": final.name,
        "published_at": time.time(),
        **(extra or {}),
    }
    m["versions"].append(entry)
    m["latest"] = version
    atomic_write_text(root / MANIFEST, json.dumps(m, indent=2) + "\n")
    return version


def publish_checkpoint(root: str | Path, run_dir: str | Path, data_seen_per_step: int, **extra):
    """Publish the latest checkpoint of the training run `run_dir` unless its step is already
    the manifest's latest (a restarted publisher does not publish twice). Returns
    (version, steps)."""
    from drafttrain.export.directory import checkpoint_drafter
    from drafttrain.jobs.config import load_train_config
    from drafttrain.trainer.checkpoint import latest_checkpoint

    run = Path(run_dir)
    ckpt = latest_checkpoint(run / "checkpoints")
    if ckpt is None:
        raise CheckpointError(f"no checkpoint to publish under {run / 'checkpoints'}")
    cfg = load_train_config(run / "training_args.yaml")
    drafter, state, _ = checkpoint_drafter(ckpt, cfg.target.name_or_path)
    steps = int(state["step"])
    m = read_manifest(root)
    if m["versions"] and m["versions"][-1]["steps"] == steps:
        return int(m["latest"]), steps
    meta = {"target": None, "trained_steps": steps, **state.get("objective", {})}
    v = publish(root, drafter, meta, steps, steps * data_seen_per_step, extra=extra)
    return v, steps


class VersionWatcher:
    """The runner's side: `poll(running_version)` -> the newest published version above
    `running_version` as a `DrafterUpdate` (None when there is none). Call it between rounds
    (`SpecDecoder.generate(between_rounds=...)`); versions published in between are skipped,
    as an engine that applies only the newest weights would."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def poll(self, running_version: int) -> DrafterUpdate | None:
        m = read_manifest(self.root)
        if m["latest"] <= running_version:
            return None
        entry = m["versions"][-1]
        return DrafterUpdate.from_export(self.root / entry["dir"], entry["version"], entry)

    def between_rounds(self, decoder) -> None:
        """`SpecDecoder.generate`'s callback: stage the newest version, if any."""
        update = self.poll(decoder.drafter_version)
        if update is not None:
            decoder.update_drafter(update)
