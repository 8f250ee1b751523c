"""Metric logging: metrics.jsonl always; wandb through the real client, offline."""

from __future__ import annotations

import json

from drafttrain.config import LoggerConfig
from drafttrain.loggers import MetricLogger, read_metrics


def test_jsonl_merges_rows_of_a_step_and_resume_overrides(tmp_path):
    log = MetricLogger(LoggerConfig(kind="none"), tmp_path, {}, resume=False)
    log.log({"loss": 2.0}, 10)
    log.log({"eval_loss": 3.0}, 10)
    log.log({"loss": 1.5}, 20)
    log.finish()
    again = MetricLogger(LoggerConfig(kind="none"), tmp_path, {}, resume=True)
    again.log({"loss": 1.4}, 20)  # re-logged after a resume
    assert read_metrics(tmp_path) == [
        {"step": 10, "loss": 2.0, "eval_loss": 3.0},
        {"step": 20, "loss": 1.4},
    ]


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricLogger(
        LoggerConfig(kind="wandb", project="t", mode="offline"), tmp_path, {"a": 1}, resume=False
    )
    log.log({"loss": 1.0}, 1)
    log.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"] == 1.0
