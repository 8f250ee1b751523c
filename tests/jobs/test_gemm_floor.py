"""The GEMM floor (`draftbench/gemm_floor.py`, `draftbench.train_step --gemm-floor`): the
matrix products of a step recorded with their shapes, layouts and FLOPs, and replayed alone.
FLOPs are checked against 2 M N K written out from the shapes the test chose, and the
training step's against the GEMMs its loss is documented to issue
(`drafttrain/objectives/position_loss.py`)."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from draftbench import gemm_floor, train_step


def test_record_sees_each_product_with_its_shape_layout_and_flops():
    x = torch.randn(5, 7, dtype=torch.bfloat16)
    w = torch.randn(3, 7, dtype=torch.bfloat16)
    b = torch.randn(3, dtype=torch.bfloat16)
    a3, b3 = torch.randn(2, 4, 6), torch.randn(2, 6, 3)

    def step():
        F.linear(x, w)  # mm, weight transposed
        F.linear(x, w, b)  # addmm
        torch.bmm(a3, b3)
        torch.baddbmm(torch.zeros(2, 4, 3), a3, b3)
        (x.float() + 1).sum()  # not a product

    calls = gemm_floor.record(step)
    assert [g.label() for g in calls] == [
        "mm [5,7]x[7,3] NT BFloat16",
        "addmm [5,7]x[7,3] NT BFloat16",
        "bmm 2x[4,6]x[6,3] NN float",
        "baddbmm 2x[4,6]x[6,3] NN float",
    ]
    assert [g.flops for g in calls] == [2 * 5 * 3 * 7] * 2 + [2 * 2 * 4 * 3 * 6] * 2
    out = gemm_floor.replay(calls, torch.device("cpu"), repeats=2)
    assert out["calls"] == 4 and out["floor_ms"] > 0
    assert abs(out["tflop"] * 1e12 - (2 * 210 + 2 * 288)) < 1e-3
    assert sorted(s["calls"] for s in out["by_shape"]) == [1, 1, 1, 1]


def test_record_sees_backward_products():
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(3, 7, requires_grad=True)
    dy = torch.randn(5, 3)
    calls = gemm_floor.record(lambda: F.linear(x, w).backward(dy))
    # (batch, M, N, K): forward [5,7] x [7,3]; backward dw = dy^T [3,5] x x [5,7] and
    # dx = dy [5,3] x w [3,7]
    assert sorted(g.mnk for g in calls) == [(1, 3, 7, 5), (1, 5, 3, 7), (1, 5, 7, 3)]
    # dy^T is a transposed view: recorded with its strides, replayed with them
    dw = next(g for g in calls if g.mnk == (1, 3, 7, 5))
    assert dw.layout[0] == "T" and dw.operands[0][1] == (1, 3)


def test_train_step_reports_the_floor_of_each_row(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    argv = ["train_step", "--device", "cpu", "--tiny", "--seqs", "64", "--kinds", "eagle3:3"]
    argv += ["--no-peer", "--no-ac-variant", "--gemm-floor", "--steps", "1", "--warmup", "0"]
    monkeypatch.setattr(sys, "argv", argv + ["--out", str(out)])
    train_step.main()
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    trained, frozen = rows["ours"]["gemm_floor"], rows["ours+fh"]["gemm_floor"]
    assert trained["calls"] > 0 and trained["floor_ms"] > 0 and frozen["floor_ms"] > 0
    # D-PACE with a trained head: a weights pass over the head, then the logits again with
    # the input and weight gradients (4 head GEMMs a TTT step); frozen: one pass, logits and
    # the input gradient (2). The difference: 2 GEMMs of [64 rows, 64] x [64, 128 draft
    # vocabulary] in each of the 3 TTT steps.
    head_gemm = 2 * 64 * 64 * 128
    assert round((trained["tflop"] - frozen["tflop"]) * 1e12) == 3 * 2 * head_gemm
    table = capsys.readouterr().out
    assert "| ours eagle3 | 3 | 64 |" in table and "| ours+fh eagle3 | 3 | 64 |" in table


def test_floor_table_budgets_the_eagle3_bars_from_the_adamw_peer():
    floor = {"floor_ms": 200.0, "tflop": 150.0, "tflop_per_s": 750.0, "calls": 300}
    base = {"kind": "eagle3", "k": 7, "seq_len": 8192}
    rows = [
        {**base, "impl": "peer+adamw", "step_ms_median": 260.0},
        {**base, "impl": "ours", "step_ms_median": 320.0, "gemm_floor": floor},
        {**base, "impl": "ours+fh", "step_ms_median": 250.0, "gemm_floor": floor},
    ]
    lines = train_step.floor_table(rows).splitlines()
    assert lines[2] == "| ours eagle3 | 7 | 8192 | 320.0 | 200.0 | 0.62 | 150.0 | 750 " + (
        "| 200.0 (1.3x AdamW peer) |"
    )
    assert lines[3].endswith("| 185.7 (1.4x AdamW peer) |")
    assert train_step.floor_table([rows[0]]) == ""


def test_an_accumulation_in_place_is_replayed_in_place():
    acc, a, b = torch.zeros(4, 3), torch.randn(4, 5), torch.randn(5, 3)
    calls = gemm_floor.record(lambda: (torch.addmm(acc, a, b, out=acc), torch.addmm(acc, a, b)))
    assert [g.in_place for g in calls] == [True, False]
    assert gemm_floor.replay(calls, torch.device("cpu"), repeats=1)["calls"] == 2


def test_an_fp32_accumulator_of_bf16_products_is_replayed_with_its_out_dtype():
    acc = ((4, 3), (3, 1), "float")
    a, b = ((4, 5), (5, 1), "c10::BFloat16"), ((5, 3), (1, 5), "c10::BFloat16")
    mixed = gemm_floor.Gemm("aten::addmm", (acc, a, b), 120)
    fn = gemm_floor.call_of(mixed)
    assert fn.func is torch.addmm and fn.keywords == {"out_dtype": torch.float32}
    assert gemm_floor.call_of(mixed._replace(op="aten::mm", operands=(a, b))) is torch.mm
    assert gemm_floor.call_of(mixed._replace(operands=(acc, acc, acc))) is torch.addmm
