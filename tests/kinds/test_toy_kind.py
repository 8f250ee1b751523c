"""A new drafter kind is new files plus a registration (DESIGN 2.1 seam 1).

The kind under test, `toymlp` (`tests/support/toy_mlp_kind.py`), is defined outside the
package and shares no code with the shipped kinds: no attention, no RoPE, no KV cache, no draft
vocabulary, one tap. Registered here on both sides, it goes through composing the config tree,
training, export, loading the export from disk, the runner's lossless check and the model
card without any package file edited; a multimodal target is refused for it in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore

from draftinfer.files.checkpoint import load_drafter
from draftinfer.registry import DRAFTERS
from drafttrain.registry import TRAIN_SPECS
from tests.support import toy_mlp_kind as toy

pytestmark = pytest.mark.slow


@pytest.fixture
def toy_kind():
    toy.register()
    # What `conf/drafttrain/drafter/<kind>.yaml` would be for a kind shipped in the package.
    ConfigStore.instance().store(group="drafter", name=toy.KIND, node=toy.ToyMLPTrainConfig)
    yield toy.KIND
    toy.unregister()


def test_toy_kind_trains_exports_loads_and_is_lossless(toy_kind, tmp_path, zoo_target):
    from drafttrain.jobs.job import run_job
    from tests.support.presets import compose_preset

    assert toy.KIND in DRAFTERS and toy.KIND in TRAIN_SPECS
    cfg = compose_preset(
        "eagle3",
        [
            f"drafter={toy_kind}",
            f"output_dir={tmp_path}",
            "drafter.steps=2",
            "trainer.max_steps=60",
            "trainer.warmup_steps=10",
            "trainer.progress=false",
            "trainer.save_every=0",
            "data.eval_split=null",
            "export.verify_prompts=12",
            "export.verify_max_new_tokens=24",
        ],
    )
    assert type(cfg.drafter) is toy.ToyMLPTrainConfig
    summary = run_job(cfg)
    export = Path(summary["export_dir"])
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["ToyMLPDrafter"]
    assert config["drafttrain"]["drafter_kind"] == toy.KIND
    drafter, _ = load_drafter(export, zoo_target.shared_weights())
    assert type(drafter) is toy.ToyMLPDrafter
    report = summary["runner"]
    assert report.drafter_kind == toy.KIND and report.lossless is True
    assert report.acceptance_length > 1.1  # it learned something and drafts were accepted
    assert f"# {toy.KIND} drafter" in (export / "README.md").read_text()


def test_toy_kind_refuses_a_multimodal_family_in_one_line(toy_kind):
    from draftinfer.files.errors import CheckpointError, ConfigError
    from draftinfer.registry import check_pair, drafter_spec, family_spec

    with pytest.raises((CheckpointError, ConfigError)) as e:
        check_pair(drafter_spec(toy.KIND), family_spec("qwen3_vl"))
    assert "\n" not in str(e.value) and toy.KIND in str(e.value)
