from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from draftinfer.evaluation.threads import retain_freed_memory

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Each of xdist's worker processes (`-n 2` in pyproject.toml) gets its share of the cores, so
# two workers on the 2-core machine do not oversubscribe it; one process alone takes two.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
# Large CPU tensors reuse the heap instead of being mapped and faulted in afresh on every op
# (the runner's [rows, vocab] temporaries): the statistical sampling tests run about twice
# as fast (`draftinfer.evaluation.threads.retain_freed_memory`).
retain_freed_memory()
# On a CPU-only machine every Triton kernel runs through the interpreter (DESIGN section 5);
# this must be set before any `@triton.jit` module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="statistical tests run every case with twice the samples (minutes each)",
    )
    parser.addoption(
        "--inductor",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an inductor setting (torch._inductor.config) for every CUDA SpecDecoder compile "
        "given no compile_options (added to draftinfer.decoding.compiled.RUNNER_CUDA_OPTIONS), e.g. "
        "combo_kernels=False: the GPU tests of a candidate runner default "
        "(scripts/gpu_suite.sh's INDUCTOR); training's compiles keep inductor's defaults",
    )


def pytest_configure(config):
    import ast

    from draftinfer.decoding.compiled import RUNNER_CUDA_OPTIONS, unknown_inductor_settings

    for item in config.getoption("--inductor"):
        name, eq, value = item.partition("=")
        if not eq or unknown_inductor_settings([name]):
            raise pytest.UsageError(
                f"--inductor {item!r}: expected NAME=VALUE, NAME an inductor setting"
            )
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value
        RUNNER_CUDA_OPTIONS[name] = parsed


# Marks whose tests may skip in CI: no GPU there. Any other skip means a test CI never runs:
# under CI=true it fails the session (`.ci/run` sets it).
CI_MAY_SKIP = ("gpu", "multi_gpu")
_SKIPPED: list[str] = []
# Measurements a test records (`record_property`) that the run's summary prints, e.g. the max
# logit difference of each third-party loader check.
_PRINTED_PROPERTIES = ("max_abs_logit_diff",)
_MEASURED: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and not any(m in report.keywords for m in CI_MAY_SKIP):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        _SKIPPED.append(f"{report.nodeid}: {reason}")
    if report.when == "call":
        for name, value in report.user_properties:
            if name.endswith(_PRINTED_PROPERTIES):
                _MEASURED.append(f"{report.nodeid}: {name} = {value:.3e}")


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        print("\nCI runs every test but gpu / multi_gpu ones; these skipped:")
        for line in _SKIPPED:
            print(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Session fixtures that train a model (a zoo recipe per kind, a preset's short recipe): a test
# that uses one is an integration test and is marked slow, whatever its own marks, so
# `pytest -m "not slow"` (the quick loop) never trains; CI's `python -m pytest` runs them all.
TRAINING_FIXTURES = ("zoo_run", "kind_env", "preset_run")


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by `-m`
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(f in item.fixturenames for f in TRAINING_FIXTURES):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu mark)")
    for item in items:
        if "gpu" in item.keywords or "multi_gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    at tiny shapes intra-op threads only add barrier waits (CPU flash attention spins for
    milliseconds per call on a busy 2-core box, where xdist already runs a worker per core).
    Restored for other modules."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory):
    from tests.support.tiny_models import llama3_config, save_tiny_target

    return save_tiny_target(llama3_config(), tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from tests.support.tiny_models import qwen3_config, save_tiny_target

    return save_tiny_target(qwen3_config(), tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def train_env(tmp_path_factory):
    from tests.support.tiny_models import make_train_env

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
    from draftinfer.files.loading import load_native_target
    from draftinfer.files.paths import resolve_path

    return load_native_target(resolve_path("zoo:llama-tiny"), max_batch=16, max_seq_len=384)


@pytest.fixture(scope="session")
def zoo_run(tmp_path_factory):
    """`zoo_run(kind)` -> the job summary of the zoo recipe for `kind` (trained once)."""
    from drafttrain.jobs.job import run_job
    from tests.support.presets import compose_preset, text_preset_of
    from tests.support.shared_runs import shared_run

    runs: dict[str, dict] = {}

    def build(kind: str, out) -> dict:
        # The kind's own text preset (eagle3, ptd_eagle3, mtp3), shortened: its golden
        # values (`tests/jobs/test_zoo_e2e.py`) pin that preset's recipe.
        preset = text_preset_of(kind)
        choose = [] if preset else [f"drafter={kind}"]
        overrides = [*choose, f"output_dir={out}", *ZOO_RECIPE]
        overrides += ZOO_KIND_OVERRIDES.get(kind, [])
        return run_job(compose_preset(preset or "eagle3", overrides))

    def get(kind: str) -> dict:
        if kind not in runs:  # trained once per session, whichever worker asks first
            runs[kind] = shared_run(tmp_path_factory, f"zoo_{kind}", partial(build, kind))
        return runs[kind]

    return get


@pytest.fixture(scope="session")
def preset_run(tmp_path_factory):
    """`preset_run(name)` -> the job summary of CPU preset `name`'s shortened recipe
    (`tests.support.presets.short_recipe`), run once per session with one intra-op thread for
    the whole job (training, export and the runner's check), so its numbers are deterministic."""
    from draftinfer.evaluation.threads import torch_threads
    from drafttrain.jobs.job import run_job
    from tests.support.presets import compose_preset, short_recipe
    from tests.support.shared_runs import shared_run

    runs: dict[str, dict] = {}

    def build(name: str, out) -> dict:
        cfg = compose_preset(name, [f"output_dir={out}", *short_recipe(name)])
        with torch_threads(1):
            return run_job(cfg)

    def get(name: str) -> dict:
        if name not in runs:  # run once per session, whichever worker asks first
            runs[name] = shared_run(tmp_path_factory, f"preset_{name}", partial(build, name))
        return runs[name]

    return get


@pytest.fixture
def kind_env(zoo_run, zoo_target):
    """`kind_env(kind)` -> {"target", "drafter", "export", "summary"}: the zoo recipe's export
    of `kind` loaded from disk against the native zoo target."""
    from draftinfer.files.checkpoint import load_drafter

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
