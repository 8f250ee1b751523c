"""Every CPU preset's numbers pinned (issue 21 item 5), and its export read from outside.

A text preset (eagle3, ptd_eagle3, mtp3) is pinned through its kind's zoo recipe, the preset
shortened (`tests/conftest.py::zoo_run`, golden values `tests/golden/<kind>.json`, checked in
`tests/jobs/test_zoo_e2e.py`). Every other CPU preset (the Qwen3-VL ones) runs its shortened
recipe here (`tests.support.presets.short_recipe`: 120 steps, 60 for the MoE presets, about a
minute each on two idle cores; a full preset is 600 to 1200 steps and 5 min) with one intra-op thread for the whole job,
and its per-step losses and runner AL are compared with `tests/golden/presets/<preset>.json`:
a drop of more than 0.05 in AL fails. Its export is then read by the independent engine
readers of its kind, grepped for machine paths, and, where its kind has a speculators layout,
loaded by speculators 0.9.0 as written.

After an intended change of the numerics, regenerate with
`DRAFTTRAIN_UPDATE_GOLDEN=1 python -m pytest tests/jobs/test_preset_golden.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from draftinfer.files.checkpoint import SPECULATORS_DIR
from draftinfer.registry import registered_kinds
from tests.support.engine_readers import (
    files_naming,
    machine_paths,
    readers_for,
    run_record,
    shipped,
)
from tests.support.presets import cpu_presets, text_preset_of

pytestmark = pytest.mark.slow
GOLDEN = Path(__file__).parents[1] / "golden"
AL_DROP = 0.05  # the largest acceptance drop a change may cause silently
AL_FLOOR = 1.3  # the shortened recipes' drafters accept (an untrained one stays near 1.0)
KIND_PRESETS = {text_preset_of(k) for k in registered_kinds()} - {None}
OTHER_PRESETS = sorted(set(cpu_presets()) - KIND_PRESETS)
# Presets whose export no merged engine loads (its card says so): the engine readers refuse it.
# LiLiCorr: ModelOpt #2342 trains it; SGLang #37462 and vLLM #57934 that would serve it are open.
UNSERVED = {"lilicorr": "LiLiCorrDraftModel"}


def test_every_cpu_preset_is_pinned():
    """Each CPU preset has golden values: a kind's text preset through its zoo recipe, any
    other one here."""
    presets = cpu_presets()
    assert {"eagle3", "ptd_eagle3", "mtp3", "qwen3_vl_eagle3", "qwen3_vl_ptd"} <= set(presets)
    for kind in registered_kinds():
        preset = text_preset_of(kind)
        assert preset is None or (GOLDEN / f"{kind}.json").is_file(), kind
    for name in OTHER_PRESETS:
        assert (GOLDEN / "presets" / f"{name}.json").is_file() or os.environ.get(
            "DRAFTTRAIN_UPDATE_GOLDEN"
        ) == "1", f"no golden values for preset {name!r}: run with DRAFTTRAIN_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("preset", OTHER_PRESETS)
def test_preset_golden_losses_and_acceptance(preset_run, preset):
    summary = preset_run(preset)
    rep = summary["runner"]
    assert rep.lossless is True
    assert rep.acceptance_length >= AL_FLOOR, rep.acceptance_length
    walk = summary["sim_walk_al"]
    if isinstance(walk, str):  # image prompts: the walk does not feed images yet
        assert walk.startswith("skipped: image prompts"), walk
    else:  # the training-time walk AL predicts the runner's (drafttrain.jobs.walk_al)
        assert abs(summary["walk_gap"]) <= 0.05, (walk, rep.acceptance_length)
    got = {
        "losses": [round(x, 5) for x in summary["losses"]],
        "acceptance_length": round(rep.acceptance_length, 4),
        "per_position_acceptance": [round(x, 4) for x in rep.per_position_acceptance],
    }
    path = GOLDEN / "presets" / f"{preset}.json"
    if os.environ.get("DRAFTTRAIN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    print(f"{preset}: AL {got['acceptance_length']} (golden {want['acceptance_length']})")
    assert len(got["losses"]) == len(want["losses"])
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert a == pytest.approx(b, rel=2e-3, abs=2e-3), f"step {step}: loss {a} vs golden {b}"
    assert got["acceptance_length"] >= want["acceptance_length"] - AL_DROP, (
        f"acceptance length {got['acceptance_length']} dropped below golden "
        f"{want['acceptance_length']} - {AL_DROP}"
    )


@pytest.mark.parametrize("preset", OTHER_PRESETS)
def test_preset_export_read_from_outside(preset_run, preset, tmp_path_factory):
    """The preset's export, read as its engines read it, names no machine path, and (kinds
    with a speculators layout) loads in speculators 0.9.0 as written."""
    from tests.support.speculators_env import (
        VERIFIER_OWNED,
        load_speculators_folder,
        speculators_python,
    )

    summary = preset_run(preset)
    export, kind = Path(summary["export_dir"]), cpu_presets()[preset].drafter.kind
    rec = run_record(summary["run_dir"])
    if preset in UNSERVED:
        from tests.support.engine_readers import vllm_sglang_dflash

        with pytest.raises(AssertionError, match=UNSERVED[preset]):
            vllm_sglang_dflash(export, rec)
        assert not (export / SPECULATORS_DIR).exists()
        paths = machine_paths(summary["run_dir"], export, tmp_path_factory.getbasetemp())
        ship = shipped(export, tmp_path_factory.mktemp(f"ship_{preset}") / "export")
        assert not files_naming(ship, paths)
        return
    views = [read(export, rec) for read in readers_for(kind, rec)]
    if rec.draft_vocab is not None:
        assert all(
            v.draft_vocab is not None and v.draft_vocab.equal(rec.draft_vocab) for v in views
        )
    paths = machine_paths(summary["run_dir"], export, tmp_path_factory.getbasetemp())
    # As shipped: locally speculators' verifier of a zoo target is its absolute directory.
    ship = shipped(export, tmp_path_factory.mktemp(f"ship_{preset}") / "export")
    assert not files_naming(ship, paths)
    folder = export / SPECULATORS_DIR
    if folder.is_dir():
        assert speculators_python() is not None, "no speculators venv (.ci/run creates it)"
        meta = load_speculators_folder(folder, tmp_path_factory.mktemp(f"spec_{preset}"))
        print(f"{preset}: speculators loaded {meta}")
        assert meta["unused_in_folder"] == []
        assert set(meta["not_in_folder"]) <= VERIFIER_OWNED, meta["not_in_folder"]
