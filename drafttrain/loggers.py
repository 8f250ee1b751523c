"""Metric loggers: `metrics.jsonl` in the run directory always, wandb when `logger=wandb`.

wandb runs through the real client, offline by default (no network needed; `wandb sync`
uploads later). Tests use `logger=none`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from drafttrain.config import LoggerConfig
from drafttrain.errors import ConfigError


class MetricLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], resume: bool):
        self.path = run_dir / "metrics.jsonl"
        if not resume and self.path.exists():
            self.path.unlink()
        self.wandb = None
        if cfg.kind == "wandb":
            import wandb

            self.wandb = wandb.init(
                project=cfg.project,
                name=cfg.run_name,
                mode=cfg.mode,
                dir=str(run_dir),
                config=config,
                resume="allow" if resume else None,
            )
        elif cfg.kind != "none":
            raise ConfigError(f"logger.kind must be 'none' or 'wandb', got {cfg.kind!r}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # Rows of one step merge (training and eval metrics); after a resume, steps past the
    # checkpoint were logged twice and the later values win.
    by_step: dict[int, dict[str, float]] = {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update(r)
    return [by_step[s] for s in sorted(by_step)]
