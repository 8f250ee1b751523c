"""R1: every preset composes against the schema; a misspelled key is an error naming it;
the argv shim; the resolved config is written into the run directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from draftinfer.files.errors import DraftError
from draftinfer.registry import registered_kinds
from drafttrain.__main__ import CONF_DIR, presets, rewrite_argv
from drafttrain.jobs.config import DrafterTrainConfig, TrainConfig, check_train_config
from tests.support.presets import compose_preset

PRESETS = presets()
REPO = Path(__file__).resolve().parents[2]


def test_presets_are_the_top_level_configs_but_base_and_regenerate():
    """`presets()` (what `conf=<unknown>` lists) is every top-level config but the shared base
    and the regeneration tool's config (its own schema; tests/train/test_regenerate.py)."""
    top = {p.stem for p in Path(CONF_DIR).glob("*.yaml")}
    assert set(PRESETS) == top - {"base", "regenerate"}


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


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_passes_the_value_checks(preset):
    assert check_train_config(compose_preset(preset)).preset == preset


BAD_VALUES = [
    ("eagle3", "trainer.lr=-1", "trainer.lr must be > 0, got -1.0"),
    ("eagle3", "trainer.lr=0", "trainer.lr must be > 0, got 0.0"),
    ("eagle3", "trainer.max_steps=-5", "trainer.max_steps must be >= 1, got -5"),
    ("eagle3", "trainer.grad_accum=0", "trainer.grad_accum must be >= 1, got 0"),
    ("eagle3", "trainer.betas=[0.9,1.5]", "trainer.betas must be two values in [0, 1)"),
    ("eagle3", "trainer.min_lr_ratio=2", "trainer.min_lr_ratio must be in [0, 1]"),
    ("eagle3", "trainer.param_dtype=float64", "trainer.param_dtype must be one of"),
    ("eagle3", "trainer.loss=nope", "trainer.loss must be one of"),
    ("eagle3", "data.batch_size=0", "data.batch_size must be >= 1, got 0"),
    ("eagle3", "data.max_length=1", "data.max_length must be >= 2, got 1"),
    ("eagle3", "data.path=/no/such/chat.jsonl", "data path '/no/such/chat.jsonl' does not exist"),
    ("eagle3", "trainer.save_every=-1", "trainer.save_every must be >= 0, got -1"),
    ("eagle3", "data.cache=/no/such/cache", "data.cache: no such feature cache directory"),
    ("eagle3", "trainer.deepspeed=/no/zero2.json", "trainer.deepspeed: no such DeepSpeed"),
    ("eagle3", "target.name_or_path=./no/such/dir", "target not found: './no/such/dir'"),
    ("eagle3", "export.verify_k=0", "export.verify_k must be >= 1, got 0"),
    ("eagle3", "export.verify_extra_k=[2,-1]", "export.verify_extra_k must be >= 1, got [-1]"),
    ("eagle3", "eval.every_n_steps=-1", "eval.every_n_steps must be >= 0"),
    ("eagle3", "drafter.ttt_steps=0", "drafter.ttt_steps must be >= 1, got 0"),
    ("eagle3", "drafter.num_layers=0", "drafter.num_layers must be >= 1, got 0"),
    ("eagle3", "drafter.aux_layer_ids=[1,-2,3]", "drafter.aux_layer_ids must be >= 0"),
    ("ptd_eagle3", "drafter.parallel_k=0", "drafter.parallel_k must be >= 1, got 0"),
    ("ptd_eagle3", "drafter.keep_ratio=1.5", "drafter.keep_ratio must be in [0, 1]"),
    ("mtp3", "drafter.n_predict=0", "drafter.n_predict must be >= 1, got 0"),
    ("mtp3", "drafter.init=zeros", "drafter.init must be one of"),
    ("dflash", "drafter.block_size=1", "drafter.block_size must be >= 2, got 1"),
    ("dflash", "drafter.loss=mse", "drafter.loss must be one of ['ce', 'kl']"),
]


@pytest.mark.parametrize("preset, override, message", BAD_VALUES)
def test_a_value_no_run_can_use_is_a_one_line_error(preset, override, message):
    with pytest.raises(DraftError) as e:  # ConfigError; TargetError for the target
        check_train_config(compose_preset(preset, [override]))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (["conf=eagle3", "trainer.lr=-1"], "error: trainer.lr must be > 0, got -1.0"),
        (["conf=nosuchpreset"], "error: unknown preset conf='nosuchpreset' (presets: dflash, "),
    ],
)
def test_cli_refuses_bad_values_and_presets_before_writing_anything(tmp_path, args, message):
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "drafttrain", *args, f"output_dir={out}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written anywhere


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
