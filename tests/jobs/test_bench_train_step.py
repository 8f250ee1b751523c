"""The training-step benchmark's dflash row (`draftbench/train_step.py`) on CPU, tiny shapes:
our block drafter built from the 8B preset (5 layers, its taps, a block of K + 1, 512 anchors
at most), the real objective and optimizer step, with blocks per step reported; and the row
order that puts speculators' DFlash (default optimizer and AdamW) beside it."""

from __future__ import annotations

import json
import math
import sys

from draftbench import train_step
from tests.support.bench_train import dflash_trainable


def test_dflash_row_tiny(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    argv = ["train_step", "--device", "cpu", "--tiny", "--seqs", "48", "--kinds", "dflash:7"]
    argv += ["--no-peer", "--steps", "1", "--warmup", "0", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    train_step.main()
    rows = json.loads(out.read_text())["rows"]
    # No head-frozen variant: a block drafter's head is the target's, never trained.
    assert [r["impl"] for r in rows] == ["ours"]
    r = rows[0]
    assert not r["oom"] and r.get("error") is None and r["tokens_per_s"] > 0
    # Anchors: tokens 1..46 of 48 (token 0 is the prompt; the last token has no next one),
    # fewer than the preset's 512, so every candidate is a block of 8 slots.
    assert r["anchors"] == 46 and r["block_size"] == 8 and r["block_rows"] == 46 * 8
    st = r["settings"]
    assert st["block_size"] == 8 and st["num_anchors"] == 512 and st["num_layers"] == 5
    # The kind's default row loss (dpace); with it the exp-decay weights are not used.
    assert st["loss_weights"] == "exp_decay" and st["gamma"] == 7.0 and st["loss"] == "dpace"
    # z-lab's build_target_layer_ids(8, 5) = [1..5] (outputs of those layers) = our taps 2..6.
    assert st["tap_layer_ids"] == [2, 3, 4, 5, 6]
    # The parameters speculators' DFlash trains at the same shape (test_peer_speculators.py).
    assert st["trainable_params"] == dflash_trainable(64, 128, 4, 2, 16, layers=5, taps=5)
    assert math.isfinite(r["loss"]) and r["loss"] > 0 and 1.0 <= r["block_al"] <= 8.0
    assert sorted(r["acc"]) == [str(s) for s in range(1, 8)]  # slots 1..7 scored
    assert (
        "| dflash | 7 | 48 |" in capsys.readouterr().out
        and "46 blocks x 8" in train_step.markdown(rows)
    )


def test_plan_puts_the_dflash_peer_beside_ours():
    rows = train_step.plan([3072], [("dflash", 15)], True, ac_variant=True, fh_variant=True)
    assert rows == [
        ("ours", "dflash", 15, 3072),
        ("ours+fh", "dflash", 15, 3072),  # skipped at run time: the head is never trained
        ("peer", "dflash", 15, 3072),
        ("peer+adamw", "dflash", 15, 3072),
    ]


def test_backends_time_each_of_our_rows_once_per_backend(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    argv = ["train_step", "--device", "cpu", "--tiny", "--seqs", "48", "--kinds", "eagle3:3"]
    argv += ["--no-peer", "--no-ac-variant", "--no-fh-variant", "--backends", "eager,flash"]
    argv += ["--steps", "1", "--warmup", "0", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    train_step.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["backend"], r["settings"]["backend"]) for r in rows] == [
        ("ours", "eager", "eager"),
        ("ours", "flash", "flash"),
    ]
    assert all(r.get("error") is None and r["tokens_per_s"] > 0 for r in rows)
    table = train_step.markdown(rows)
    assert "| eagle3 [eager] | 3 | 48 |" in table and "| eagle3 [flash] | 3 | 48 |" in table
