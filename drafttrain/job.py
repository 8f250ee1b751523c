"""The job behind `python -m drafttrain conf=<preset>`: three pure calls, then the card.

    run_dir = train(cfg)["run_dir"]      # drafttrain.train
    export_dir = export_run(run_dir)     # drafttrain.export (reads the run back from disk)
    report = verify(cfg, export_dir)     # draftinfer, on the exported files

The model card is written once, at the end, with the runner's acceptance table in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from drafttrain.config import TrainConfig
from drafttrain.export import export_run, write_model_card
from drafttrain.train import train


def verify(cfg: TrainConfig, export_dir: str | Path) -> dict[str, Any]:
    """Run `draftinfer` on the exported files (read back from disk) over held-out prompts;
    write `runner_report.json` and `acceptance.png` into the export."""
    from draftinfer.config import InferConfig
    from draftinfer.run import format_report, run_eval

    export_dir = Path(export_dir)
    e = cfg.export
    icfg = InferConfig(
        drafter=str(export_dir),
        target=cfg.target.name_or_path,
        prompts=cfg.data.path,
        prompts_split=cfg.data.eval_split or cfg.data.split,
        num_prompts=e.verify_prompts,
        k=e.verify_k,
        max_new_tokens=e.verify_max_new_tokens,
        batch_size=e.verify_batch_size,
        max_model_len=min(2048, cfg.data.max_length + e.verify_max_new_tokens + 8),
        report=str(export_dir / "runner_report.json"),
        progress=cfg.trainer.progress,
    )
    report = run_eval(icfg)
    (export_dir / "runner_report.png").replace(export_dir / "acceptance.png")
    print(format_report(report))
    return report


def run_job(cfg: TrainConfig) -> dict[str, Any]:
    """train -> export -> verify (each optional per `cfg.export`) -> model card."""
    summary = train(cfg)
    if not cfg.export.enabled:
        return summary
    run_dir = Path(summary["run_dir"])
    export_dir = export_run(run_dir, card=False)
    summary["export_dir"] = str(export_dir)
    if cfg.export.verify:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # training's memory is released: train() returned
        summary["runner"] = verify(cfg, export_dir)
    write_model_card(run_dir, export_dir)
    return summary
