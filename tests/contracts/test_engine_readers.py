"""Exports read from outside (issue 21 item 1): every layout of every registered kind's trained
zoo export, read by a small reader written from its engine's documented rule with plain `json`
and `safetensors` (`tests/support/engine_readers.py`, never `draftinfer.files.checkpoint`), checked
against the run's own record; values shared between layouts are identical; the layer taps an
engine feeds are checked against HF's `output_hidden_states`, not against our mapping; and no
file an engine or loader reads names a path of the training machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftinfer.conventions.slots import Slots
from draftinfer.files.checkpoint import SPECULATORS_DIR
from draftinfer.files.paths import ZOO_DIR, resolve_path
from draftinfer.registry import drafter_spec, registered_kinds
from tests.support.engine_readers import (
    LAYOUTS,
    files_naming,
    machine_paths,
    run_record,
    shipped,
)

pytestmark = pytest.mark.slow


def test_every_registered_kind_has_its_layouts_read():
    assert sorted(LAYOUTS) == registered_kinds(), "add the new kind's readers to LAYOUTS"


@pytest.fixture(scope="module")
def hf_zoo():
    from transformers import AutoModelForCausalLM

    # fp32, as the training target runs on CPU (the checkpoint is stored in bf16).
    path = str(ZOO_DIR / "llama-tiny")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", registered_kinds())
def test_layouts_read_as_engines_read_them(zoo_run, kind):
    summary = zoo_run(kind)
    rec = run_record(summary["run_dir"])
    export = Path(summary["export_dir"])
    views = [read(export, rec) for read in LAYOUTS[kind]]
    print({v.layout: (v.layer_taps, v.final_hidden, v.mask_token_id) for v in views})
    # The draft vocabulary each engine reads is the one training chose (its cache), and the
    # same in every layout of the export.
    vocabs = [v.draft_vocab for v in views if v.draft_vocab is not None]
    if rec.draft_vocab is not None:
        assert len(vocabs) == len(views)
        for got in vocabs:
            assert torch.equal(got, rec.draft_vocab)
    else:
        assert not vocabs
    for attr in ("layer_taps", "final_hidden", "mask_token_id"):
        assert len({repr(getattr(v, attr)) for v in views}) == 1, attr
    # Tensors present in several layouts are bit-identical.
    first = views[0].tensors
    for v in views[1:]:
        for name in ("d2t", "t2d", "mask_hidden", "fc.weight", "norm.weight", "lm_head.weight"):
            if name in first and name in v.tensors:
                assert torch.equal(first[name], v.tensors[name]), (v.layout, name)


def _training_features(rec, kind, ids):
    """What training fed the drafter: the training target's features for the drafter's
    `FeatureSpec` as the run recorded its architecture."""
    from drafttrain.frozen.target import FrozenTarget
    from drafttrain.jobs.config import TargetConfig

    arch = drafter_spec(kind).config_class(**rec.arch)
    target = FrozenTarget(TargetConfig(name_or_path=str(rec.target_dir)), torch.device("cpu"))
    pos = torch.arange(ids.shape[1])[None]
    out = target(ids, Slots(torch.arange(1), pos), arch.features)
    return out.features[0], target.info.hidden_size


@pytest.mark.parametrize("kind", registered_kinds())
def test_engine_feeds_what_training_fed(zoo_run, hf_zoo, kind):
    """The taps an engine captures for the ids it reads (slot j = HF `hidden_states[j]`, the
    input of layer j) and the final hidden it feeds MTP (HF's `last_hidden_state`, post norm)
    equal the features the drafter was trained on."""
    summary = zoo_run(kind)
    rec = run_record(summary["run_dir"])
    view = LAYOUTS[kind][0](Path(summary["export_dir"]), rec)
    ids = torch.randint(3, 4000, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_zoo(input_ids=ids, output_hidden_states=True)
        last = hf_zoo.model(input_ids=ids).last_hidden_state
        feats, H = _training_features(rec, kind, ids)
    engine = []
    for j in view.layer_taps or []:
        engine.append(ref.hidden_states[j][0])
    if view.final_hidden is not None:
        assert view.final_hidden == "post_norm"
        engine.append(last[0])
    assert engine, "the engine feeds the drafter nothing?"
    assert feats.shape[-1] == len(engine) * H
    for i, want in enumerate(engine):
        torch.testing.assert_close(feats[:, i * H : (i + 1) * H], want, rtol=1e-5, atol=1e-5)
    # A tap off by one would feed other numbers (the check above can fail).
    if view.layer_taps:
        j = view.layer_taps[0]
        assert not torch.allclose(ref.hidden_states[j + 1][0], feats[:, :H], atol=1e-3)


@pytest.mark.parametrize("kind", registered_kinds())
def test_no_machine_path_in_what_engines_read(zoo_run, kind, tmp_path_factory, tmp_path):
    """No exported file an engine reads names a path of this machine. One field may, in the
    local export only: speculators' verifier of a target with no hub id is the target's
    absolute directory (so speculators resolves it from anywhere on this machine); the Hub
    upload names the hub id there (`drafttrain.export.hub.name_verifier`), and the shipped
    folder is what is grepped."""
    summary = zoo_run(kind)
    export = Path(summary["export_dir"])
    paths = machine_paths(summary["run_dir"], export, tmp_path_factory.getbasetemp())
    spec_cfg = export / SPECULATORS_DIR / "config.json"
    if spec_cfg.is_file():  # the local field, as written: the zoo target's own directory
        verifier = json.loads(spec_cfg.read_text())["speculators_config"]["verifier"]
        assert verifier["name_or_path"] == str(Path(resolve_path("zoo:llama-tiny")).resolve())
    ship = shipped(export, tmp_path / "shipped")
    hits = files_naming(ship, paths)
    print(f"{kind}: scanned {sum(1 for _ in ship.rglob('*'))} entries for {paths}")
    assert not hits, hits
    # The check can fail: the resolved config the user keeps does name the run directory, and
    # the local speculators config names the zoo's.
    assert str(summary["run_dir"]).encode() in (ship / "training_args.yaml").read_bytes()
    if spec_cfg.is_file():
        local = files_naming(export, paths)
        assert local and all(h.startswith(f"{SPECULATORS_DIR}/config.json: ") for h in local)
