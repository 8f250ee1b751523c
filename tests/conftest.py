from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))
# On a CPU-only machine every Triton kernel runs through the interpreter (DESIGN section 5);
# this must be set before any `@triton.jit` module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="also run the `exhaustive` tests (long statistical runs, minutes each)",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--exhaustive"):
        skip_long = pytest.mark.skip(reason="exhaustive statistics: run with --exhaustive")
        for item in items:
            if "exhaustive" in item.keywords:
                item.add_marker(skip_long)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu mark)")
    for item in items:
        if "gpu" in item.keywords or "multi_gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory):
    from tests.tiny_models import llama3_config, save_tiny_target

    return save_tiny_target(llama3_config(), tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from tests.tiny_models import qwen3_config, save_tiny_target

    return save_tiny_target(qwen3_config(), tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def train_env(tmp_path_factory):
    from tests.tiny_models import make_train_env

    return make_train_env(tmp_path_factory.mktemp("train_env"))


# ---- drafters that actually accept: each registered kind, briefly trained on the zoo target --
# The shipped zoo target is trained, so a short run gives a drafter whose drafts the target
# accepts (AL well above 1): tests of acceptance, KV refresh and losslessness use these, and
# assert that drafts were accepted. One full job per kind per session (train -> export ->
# verify in the runner), shared by T1/S1/S2/S9, the golden-loss/AL test and R4.
ZOO_RECIPE = [
    "trainer.max_steps=120",
    "trainer.warmup_steps=10",
    "trainer.progress=false",
    "trainer.save_every=0",
    "trainer.log_every=10",
    "data.eval_batches=4",
    "export.verify_k=3",
    "export.verify_prompts=16",
    "export.verify_max_new_tokens=32",
]
# Per-kind additions: a chain drafter unrolls 3 TTT steps; a parallel drafter serves K <= 7
# (the T1 grid) and gets a few more steps for its K-1 extra depths; a block drafter's block of 8
# serves K <= 7.
ZOO_KIND_OVERRIDES: dict[str, list[str]] = {
    "eagle3": ["drafter.ttt_steps=3"],
    "ptd": ["drafter.parallel_k=7", "trainer.max_steps=150"],
    "mtp": [],
    # A block of 8 serves K <= 7 (the T1 grid); two layers keep the session's runs short.
    "dflash": ["drafter.block_size=8", "drafter.num_layers=2", "drafter.num_anchors=32"],
}


@pytest.fixture(scope="session")
def zoo_target():
    from draftinfer.models import load_native_target
    from draftinfer.paths import resolve_path

    return load_native_target(resolve_path("zoo:llama-tiny"), max_batch=16, max_seq_len=384)


@pytest.fixture(scope="session")
def zoo_run(tmp_path_factory):
    """`zoo_run(kind)` -> the job summary of the zoo recipe for `kind` (trained once)."""
    from drafttrain.job import run_job
    from tests.test_config import compose_preset

    runs: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"zoo_{kind}")
            overrides = [f"drafter={kind}", f"output_dir={out}", *ZOO_RECIPE]
            overrides += ZOO_KIND_OVERRIDES.get(kind, [])
            runs[kind] = run_job(compose_preset("eagle3", overrides))
        return runs[kind]

    return get


@pytest.fixture
def kind_env(zoo_run, zoo_target):
    """`kind_env(kind)` -> {"target", "drafter", "export", "summary"}: the zoo recipe's export
    of `kind` loaded from disk against the native zoo target."""
    from draftinfer.checkpoint import load_drafter

    def get(kind: str) -> dict:
        summary = zoo_run(kind)
        drafter, _ = load_drafter(summary["export_dir"], zoo_target.shared_weights())
        return {
            "target": zoo_target,
            "drafter": drafter,
            "export": summary["export_dir"],
            "summary": summary,
        }

    return get
