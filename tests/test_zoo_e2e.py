"""R4 end to end on the shipped *trained* target: a short run's loss decreases, the export
written to disk runs through `draftinfer`, the output is lossless and the acceptance length
clears a floor (not just "it runs")."""

from __future__ import annotations

import pytest

from drafttrain.loggers import read_metrics
from drafttrain.train import train
from tests.test_config import compose_preset

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "preset, overrides, k, al_floor",
    [
        ("eagle3", ["trainer.max_steps=200", "drafter.ttt_steps=3"], 3, 1.5),
        ("ptd_eagle3", ["trainer.max_steps=300"], 4, 1.35),
    ],
)
def test_short_run_reaches_acceptance_floor(tmp_path, preset, overrides, k, al_floor):
    cfg = compose_preset(
        preset,
        [
            f"output_dir={tmp_path}",
            "trainer.progress=false",
            "trainer.save_every=0",
            "data.eval_batches=4",
            f"export.verify_k={k}",
            "export.verify_prompts=24",
            "export.verify_max_new_tokens=48",
            *overrides,
        ],
    )
    summary = train(cfg)
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"]
    rep = summary["runner"]
    assert rep["lossless"] is True
    assert rep["acceptance_length"] >= al_floor, rep["acceptance_length"]
    assert len(rep["per_position_acceptance"]) == k
    card = (tmp_path / "export" / "README.md").read_text()
    assert "## Acceptance measured by the runner" in card
    assert (tmp_path / "export" / "acceptance.png").stat().st_size > 1000
