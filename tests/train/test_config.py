"""R1: every preset composes against the schema; a misspelled key is an error naming it;
the argv shim; the resolved config is written into the run directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from draftinfer.registry import registered_kinds
from drafttrain.__main__ import CONF_DIR, rewrite_argv
from drafttrain.jobs.config import DrafterTrainConfig, TrainConfig
from tests.support.presets import compose_preset

# Top-level configs that are not training presets: the shared base, and the regeneration
# tool's config (its own schema; composed in tests/test_regenerate.py).
NOT_PRESETS = {"base", "regenerate"}
PRESETS = sorted(p.stem for p in Path(CONF_DIR).glob("*.yaml") if p.stem not in NOT_PRESETS)
REPO = Path(__file__).resolve().parents[2]


def test_presets_exist():
    assert {
        "eagle3",
        "eagle3_llama3_8b",
        "eagle3_qwen3_8b",
        "ptd_eagle3",
        "ptd_eagle3_llama3_8b",
    } <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes(preset):
    cfg = compose_preset(preset)
    assert isinstance(cfg, TrainConfig)
    assert isinstance(cfg.drafter, DrafterTrainConfig)
    assert cfg.drafter.kind in registered_kinds()
    assert cfg.preset == preset
    assert cfg.output_dir


def test_gpu_presets_use_real_hub_ids():
    assert (
        compose_preset("eagle3_llama3_8b").target.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
    )
    assert compose_preset("eagle3_qwen3_8b").target.name_or_path == "Qwen/Qwen3-8B"


def test_override_and_typed_values():
    cfg = compose_preset("eagle3", ["drafter.ttt_steps=3", "trainer.lr=5e-4", "output_dir=/x"])
    assert cfg.drafter.ttt_steps == 3 and cfg.trainer.lr == 5e-4 and cfg.output_dir == "/x"


@pytest.mark.parametrize(
    "override, key",
    [("drafter.ttt_stpes=3", "ttt_stpes"), ("trainer.lrr=1", "lrr"), ("dta.path=x", "dta")],
)
def test_misspelled_key_is_an_error_naming_it(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        compose_preset("eagle3", [override])
    assert key in str(e.value) or key in str(e.value.__cause__)


def test_wrong_type_is_an_error():
    with pytest.raises(ConfigCompositionException):
        compose_preset("eagle3", ["trainer.max_steps=many"])


def test_argv_shim():
    assert rewrite_argv(["conf=ptd_eagle3", "--local_rank=3", "a=1"]) == [
        "--config-name=ptd_eagle3",
        "a=1",
    ]
    assert rewrite_argv(["--local_rank", "0", "conf=x"]) == ["--config-name=x"]
    assert rewrite_argv(["--local-rank=1", "--cfg", "job"]) == ["--cfg", "job"]


def test_cli_prints_resolved_config_and_names_typos():
    ok = subprocess.run(
        [sys.executable, "-m", "drafttrain", "conf=eagle3", "drafter.ttt_steps=5", "--cfg", "job"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "ttt_steps: 5" in ok.stdout and "name_or_path: zoo:llama-tiny" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "drafttrain", "conf=eagle3", "trainer.max_stesp=5"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "Key 'max_stesp' not in 'TrainerConfig'" in bad.stderr
