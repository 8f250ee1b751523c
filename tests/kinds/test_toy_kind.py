"""A new drafter kind is new files plus a registration (DESIGN 2.1 seam 1).

This file defines a toy kind (`toy3`, a renamed subclass of EAGLE-3 with its own config,
module, proposer and specs), registers it on both sides and runs it through composing the
config tree, training, export, loading the export from disk and the runner's lossless check,
without any package file edited.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore

from draftinfer.checkpoint import load_drafter
from draftinfer.kinds.eagle3 import Eagle3ChainProposer, Eagle3Config, Eagle3Drafter, Eagle3Spec
from draftinfer.registry import DRAFTERS, register_drafter, unregister_drafter
from drafttrain.kinds.eagle3 import Eagle3TrainConfig, Eagle3TrainSpec
from drafttrain.registry import TRAIN_SPECS, register_train_kind, unregister_train_kind

pytestmark = pytest.mark.slow


@dataclass
class ToyConfig(Eagle3Config):
    kind = "toy3"


class ToyDrafter(Eagle3Drafter):
    pass


class ToyProposer(Eagle3ChainProposer):
    mode = "toy chain drafting"


class ToySpec(Eagle3Spec):
    name = "toy3"
    config_class = ToyConfig
    module_class = ToyDrafter
    proposer_class = ToyProposer
    mode = "toy chain drafting"


@dataclass
class ToyTrainConfig(Eagle3TrainConfig):
    kind: str = "toy3"


class ToyTrainSpec(Eagle3TrainSpec):
    name = "toy3"
    config_class = ToyTrainConfig


@pytest.fixture
def toy_kind():
    register_drafter(ToySpec())
    register_train_kind(ToyTrainSpec())
    # What `conf/drafter/<kind>.yaml` would be for a kind shipped in the package.
    ConfigStore.instance().store(group="drafter", name="toy3", node=ToyTrainConfig)
    yield "toy3"
    unregister_drafter("toy3")
    unregister_train_kind("toy3")


def test_toy_kind_trains_exports_loads_and_is_lossless(toy_kind, tmp_path, zoo_target):
    from drafttrain.job import run_job
    from tests.support.presets import compose_preset

    assert "toy3" in DRAFTERS and "toy3" in TRAIN_SPECS
    cfg = compose_preset(
        "eagle3",
        [
            f"drafter={toy_kind}",
            f"output_dir={tmp_path}",
            "drafter.ttt_steps=2",
            "drafter.draft_vocab_size=2048",
            "trainer.max_steps=60",
            "trainer.warmup_steps=10",
            "trainer.progress=false",
            "trainer.save_every=0",
            "data.eval_split=null",
            "export.verify_prompts=12",
            "export.verify_max_new_tokens=24",
        ],
    )
    assert type(cfg.drafter) is ToyTrainConfig
    summary = run_job(cfg)
    export = Path(summary["export_dir"])
    config = json.loads((export / "config.json").read_text())
    assert config["drafttrain"]["drafter_kind"] == "toy3"
    drafter, _ = load_drafter(export, zoo_target.shared_weights())
    assert type(drafter) is ToyDrafter
    report = summary["runner"]
    assert report["drafter_kind"] == "toy3" and report["lossless"] is True
    assert report["acceptance_length"] > 1.1  # it learned something and drafts were accepted
    assert "# toy3 drafter" in (export / "README.md").read_text()
