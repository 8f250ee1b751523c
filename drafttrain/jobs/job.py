"""The job behind `python -m drafttrain conf=<preset>`: three pure calls, then the card.

    run_dir = train(cfg)["run_dir"]      # drafttrain.jobs.train
    export_dir = export_run(run_dir)     # drafttrain.export.directory (reads the run back from disk)
    report = verify(cfg, export_dir)     # draftinfer, on the exported files

The model card is written once, at the end, with the runner's acceptance table in it; with
`export.push_to_hub=ORG/NAME` the export is then uploaded (`drafttrain.export.hub`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftinfer.evaluation.report import RunReport
from draftinfer.evaluation.threads import torch_threads
from drafttrain.export.card import RUNNER_PLOT, RUNNER_REPORT, runner_reports, write_model_card
from drafttrain.export.directory import export_run
from drafttrain.jobs.config import TrainConfig, check_train_config
from drafttrain.jobs.errors import ConfigError
from drafttrain.jobs.runner_eval import verify_config
from drafttrain.jobs.train import train


def verify(cfg: TrainConfig, export_dir: str | Path, k: int | None = None) -> RunReport:
    """Run `draftinfer` on the exported files (read back from disk) over held-out prompts
    (`data.eval_split` of `data.eval_path`, default `data.path`) at `k` drafts per round
    (default `export.verify_k`): `runner_report.json` and `acceptance.png` for `verify_k`,
    `runner_report_k{K}.json` for other K."""
    from draftinfer.evaluation.run import format_report, run_eval

    export_dir = Path(export_dir)
    e = cfg.export
    k = e.verify_k if k is None else k
    name = RUNNER_REPORT if k == e.verify_k else f"runner_report_k{k}.json"
    icfg = verify_config(
        cfg,
        export_dir,
        k,
        report=str(export_dir / name),
        plot=str(export_dir / RUNNER_PLOT) if k == e.verify_k else "none",
    )
    report = run_eval(icfg)
    print(format_report(report))
    return report


def check_job(cfg: TrainConfig) -> str | None:
    """One-line errors for export settings that would fail only after training; returns the
    Hub card's `base_model` when the job uploads."""
    e = cfg.export
    if not e.push_to_hub:
        return None
    if not e.enabled:
        raise ConfigError("export.push_to_hub needs export.enabled=true")
    from drafttrain.export.hub import check_push

    return check_push(e.push_to_hub, cfg.target, e)


def run_job(cfg: TrainConfig) -> dict[str, Any]:
    """train -> export -> verify (each optional per `cfg.export`) -> model card -> Hub upload
    (`export.push_to_hub`). Every check of the later stages runs before training. The whole
    job runs with `trainer.num_threads` intra-op threads (when set)."""
    with torch_threads(cfg.trainer.num_threads):
        return _run_job(cfg)


def _run_job(cfg: TrainConfig) -> dict[str, Any]:
    base_model = check_job(check_train_config(cfg))
    if cfg.online.drift:  # the drift demonstration job (`conf=online_drift`)
        from drafttrain.online.drift import run_online_drift

        return run_online_drift(cfg)
    summary = train(cfg, keep_logger=True)
    logger = summary.pop("logger")
    try:
        if not cfg.export.enabled or not summary["main_process"]:
            return summary  # under a launcher only the main process exports and uploads
        run_dir = Path(summary["run_dir"])
        export_dir = export_run(run_dir, card=False)
        summary["export_dir"] = str(export_dir)
        if cfg.export.verify:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # training's memory is released: train() returned
            summary["runner"] = verify(cfg, export_dir)
            if isinstance(summary.get("sim_walk_al"), float):
                al = summary["runner"].acceptance_length
                summary["walk_gap"] = summary["sim_walk_al"] - al
                print(
                    f"training-time walk AL {summary['sim_walk_al']:.3f} vs the runner's "
                    f"{al:.3f} (gap {summary['walk_gap']:+.3f})"
                )
            for k in cfg.export.verify_extra_k:
                if k != cfg.export.verify_k:
                    verify(cfg, export_dir, k)
            logger.log_runner(
                runner_reports(export_dir), export_dir / RUNNER_PLOT, cfg.trainer.max_steps
            )
        write_model_card(run_dir, export_dir)
        if cfg.export.push_to_hub:
            from drafttrain.export.hub import push_to_hub

            summary["hub"] = push_to_hub(
                run_dir, export_dir, cfg.export.push_to_hub, base_model, cfg.export.hub_private
            )
            print(summary["hub"])
    finally:
        logger.finish()
    return summary
