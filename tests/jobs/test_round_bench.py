"""`draftbench.round` on the tiny GLM-4.7-Flash shape (MLA + MoE) on the CPU: the mtp kind is
the target's own released MTP layer (`drafter=native`, N = 1, reused at K = 2 and 3), timed
at K = 1..3 against the plain step through the real engine, lossless; the floor counts the
latent cache (kv_lora_rank + qk_rope_head_dim values per position per layer) and the routed
experts the step touches; a reference target's plain step is timed first in the same process,
its fraction of the copy bandwidth beside the target's. The lead runs it on a GPU at the real
shapes (`--targets glm-4.7-flash --reference-targets llama3.1-8b`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from draftbench.shapes import TINY_GLM_4_7_FLASH as S

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 16


def test_round_times_the_released_mtp_layer_of_an_mla_target(tmp_path):
    out = tmp_path / "round.json"
    argv = ["--device", "cpu", "--targets", "tiny-glm-4.7-flash", "--reference-targets", "tiny"]
    argv += ["--batches", "1", "--kinds", "mtp", "--ks", "1,2,3", "--context", str(CONTEXT)]
    argv += ["--rounds", "4", "--round-graphs", "off", "--compile", "none", "--no-sync-check"]
    r = subprocess.run(
        [sys.executable, "-m", "draftbench.round", *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref, res = json.loads(out.read_text())["targets"]
    assert ref["shape"] == "tiny" and ref["rows"] == []  # plain steps only
    assert res["shape"] == "tiny-glm-4.7-flash"
    assert res["mtp_drafter"] == "released (drafter=native), N=1"
    assert [(row["kind"], row["k"]) for row in res["rows"]] == [("mtp", k) for k in (1, 2, 3)]
    assert all(row["t_round_ms"] > 0 and row["ratio"] > 0 for row in res["rows"])
    assert res["lossless"] and all(v is True for v in res["lossless"].values())
    # The floor: the latent (R + dr values, fp32 here) at context + 1 positions in each of the
    # layers; each sparse layer's touched experts (top-k distinct ones for one token).
    floor = res["floor"]["1"]
    R, dr, L = S["kv_lora_rank"], S["qk_rope_head_dim"], S["num_hidden_layers"]
    assert floor["kv"] == (CONTEXT + 1) * (R + dr) * 4 * L
    sparse = S["mlp_layer_types"].count("sparse")
    assert floor["experts_touched"] == [S["num_experts_per_tok"]] * sparse
    per_expert = 3 * S["moe_intermediate_size"] * S["hidden_size"] * 4  # gate, up, down
    assert floor["experts"] == sparse * S["num_experts_per_tok"] * per_expert
    for target in (ref, res):
        plain = target["plain"]["1"]
        assert plain["fraction_of_copy"] > 0 and plain["achieved_bandwidth"] > 0
    assert "fraction of the copy bandwidth a plain step reaches" in r.stdout
    assert "tiny-glm-4.7-flash b=1:" in r.stdout and "tiny b=1:" in r.stdout


def test_round_takes_the_confidence_cut(tmp_path):
    """`--verify-threshold`: the engine's rounds run with the confidence cut on (random weights:
    the derived confidence is about 1/vocab, so every round verifies 0 drafts, one row), the
    rows record it, and the output is still lossless; a value outside (0, 1] is a one-line
    error."""
    out = tmp_path / "round.json"
    argv = ["--device", "cpu", "--tiny", "--batches", "1", "--kinds", "dflash", "--ks", "2"]
    argv += ["--context", str(CONTEXT), "--rounds", "4", "--round-graphs", "off"]
    argv += ["--compile", "none", "--no-sync-check", "--verify-threshold", "0.5"]
    cmd = [sys.executable, "-m", "draftbench.round", *argv]
    r = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert (row["kind"], row["k"], row["verify_threshold"]) == ("dflash", 2, 0.5)
    assert row["verified_rows_per_round"] == 1.0 and row["t_round_ms"] > 0
    assert all(v is True for v in res["lossless"].values())
    bad = subprocess.run([*cmd[:-1], "1.5"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--verify-threshold must be in (0, 1]" in bad.stderr
