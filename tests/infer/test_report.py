"""The runner's report is one typed record: written as JSON and read back by the same schema
(`draftinfer.evaluation.report.RunReport`); a file that is not a report is a one-line error."""

from __future__ import annotations

import json

import pytest

from draftinfer.evaluation.report import RunReport
from draftinfer.files.errors import CheckpointError


def _report(**kw) -> RunReport:
    base = dict(
        drafter="/x/export",
        target="zoo:llama-tiny",
        drafter_kind="eagle3",
        device="cpu",
        dtype="float32",
        mode="fast",
        k=3,
        temperature=0.0,
        verify="onehot",
        num_prompts=4,
        image_prompts=0,
        batch_size=4,
        max_new_tokens=16,
        rounds=20,
        acceptance_length=1.85,
        per_position_acceptance=[0.6, 0.2, 0.05],
        lossless=True,
        lossless_check="plain_greedy",
        mismatches=[],
        tokens_plain=64,
        tokens_spec=64,
        tokens_per_s_plain=100.0,
        tokens_per_s_spec=150.0,
        speedup=1.5,
    )
    return RunReport(**{**base, **kw})


def test_report_round_trips_through_json(tmp_path):
    r = _report(extra={"suite": "mt_bench"})
    path = r.write(tmp_path / "sub" / "runner_report.json")
    assert json.loads(path.read_text())["acceptance_length"] == 1.85
    assert RunReport.read(path) == r


def test_a_file_that_is_not_a_report_is_one_line_error(tmp_path):
    path = tmp_path / "r.json"
    d = _report().to_dict()
    del d["lossless"], d["k"]
    path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="missing k, lossless") as e:
        RunReport.read(path)
    assert "\n" not in str(e.value)


def test_format_report_reads_attributes():
    from draftinfer.evaluation.run import format_report

    text = format_report(_report(image_prompts=2))
    assert "1.850" in text and "(2 with images)" in text and "1.50x" in text


def test_format_report_shows_the_confidence_cut_calibration_and_sweep():
    from draftinfer.evaluation.run import format_report

    sweep = {
        "rounds": 20,
        "by_tau": {
            "full": {"al": 1.85, "verified_rows_per_round": 4.0, "expected_speedup": 1.2},
            "0.3": {"al": 1.7, "verified_rows_per_round": 2.1, "expected_speedup": 1.4},
        },
        "best": "0.3",
        "costs": "costs.json",
    }
    cal = {
        "drafts": 31,
        "accept_rate": 0.55,
        "mean_confidence": 0.5,
        "ece": 0.081,
        "auroc": 0.86,
        "brier": 0.17,
    }
    r = _report(verified_rows_per_round=4.0, extra={"calibration": cal, "threshold_sweep": sweep})
    text = format_report(r)
    assert "verified rows / round      4.000 (verify_threshold off)" in text
    assert "ECE 0.081, AUROC 0.860, Brier 0.170 over 31 reached drafts" in text
    assert "0.3: AL 1.70 rows 2.10 1.40x" in text
    assert "best threshold             0.3 (costs costs.json)" in text
    back = RunReport(**json.loads(json.dumps(r.to_dict())))
    assert back.verified_rows_per_round == 4.0 and back.verify_threshold is None
