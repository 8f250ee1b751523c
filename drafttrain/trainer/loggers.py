"""Metric loggers: `metrics.jsonl` in the run directory always, wandb when `logger=wandb`.

wandb runs through the real client, offline by default (`logger.mode: offline`: no network
needed, the run is written under `<output_dir>/wandb/`; `wandb sync` uploads it later;
`logger.mode=online` logs live). One wandb run holds the training metrics (losses, per-step /
per-depth / per-module accuracy, simulated AL) and, when the job verifies the export, the
runner's results (`log_runner`): AL and per-position acceptance per K as scalars, the AL table
as a `wandb.Table` and the per-position acceptance plot as a `wandb.Image`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftinfer.evaluation.report import RunReport
from drafttrain.jobs.config import LoggerConfig
from drafttrain.jobs.errors import ConfigError


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

    def log_runner(self, reports: list[RunReport], plot: Path | None, step: int) -> None:
        """The runner's reports (one per K, `draftinfer.evaluation.run.run_eval`) and its acceptance plot,
        at training step `step` (wandb only; `metrics.jsonl` keeps training metrics)."""
        if self.wandb is None or not reports:
            return
        import wandb

        width = max(len(r.per_position_acceptance) for r in reports)
        columns = ["K", "acceptance_length", *(f"pos_{j + 1}" for j in range(width))]
        columns += ["lossless", "tokens_per_s_spec", "speedup"]
        rows, scalars = [], {}
        for r in reports:
            pos = list(r.per_position_acceptance)
            rows.append(
                [r.k, r.acceptance_length, *pos, *[None] * (width - len(pos))]
                + [r.lossless, r.tokens_per_s_spec, r.speedup]
            )
            scalars[f"runner/k{r.k}/acceptance_length"] = r.acceptance_length
            for j, v in enumerate(pos):
                scalars[f"runner/k{r.k}/acceptance_pos_{j + 1}"] = v
        data: dict[str, Any] = {**scalars, "runner/al_table": wandb.Table(columns, rows)}
        if plot is not None and plot.is_file():
            data["runner/acceptance"] = wandb.Image(str(plot))
        self.wandb.log(data, step=step)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


class NullLogger:
    """The logger of ranks other than the main process: logs nothing."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_runner(self, reports: list[RunReport], plot: Path | None, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


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
