"""The project installs as a normal package (DESIGN 5, STYLE 18): the wheel built from the
checkout holds every package of the source tree (`kernels/` as `draftkernels`), every Hydra
preset and the whole target zoo, and nothing else; installed from the wheel, the packages find
their presets and the zoo through the installed package, from any directory.

Slow: building the wheel copies the source (~30 MB with the zoo) and fetches the build backend
from the package index into pip's isolated build environment, as a user's install does.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from tests.support.wheel_install import REPO, installed_wheel, run_installed, source_files

pytestmark = pytest.mark.slow

KERNELS_DIR, KERNELS = "kernels", "draftkernels"
CONF_DIR, CONF = "conf", "draftconf"
RENAMED = {KERNELS_DIR: KERNELS, CONF_DIR: CONF}  # folder -> import name (setup.py)
DATA_DIRS = ("conf", "draftinfer/zoo")  # package data, whole


def _installed_name(rel: str) -> str:
    """A source path as the wheel names it (`kernels/x.py` -> `draftkernels/x.py`,
    `conf/drafttrain/base.yaml` -> `draftconf/drafttrain/base.yaml`)."""
    head, sep, rest = rel.partition("/")
    return RENAMED[head] + sep + rest if head in RENAMED else rel


def _source_packages(files: list[str]) -> set[str]:
    """Folders of the source tree that are packages: those with an `__init__.py` (but tests),
    and `kernels/` (a namespace folder, installed as `draftkernels`)."""
    pkgs = {str(PurePosixPath(f).parent) for f in files if f.endswith("/__init__.py")}
    return {p for p in pkgs if p.split("/")[0] != "tests"} | {KERNELS_DIR}


def _expected_files() -> set[str]:
    files = source_files()
    pkgs = _source_packages(files)
    code = {f for f in files if f.endswith(".py") and str(PurePosixPath(f).parent) in pkgs}
    data = {f for f in files if f.startswith(tuple(d + "/" for d in DATA_DIRS))}
    return {_installed_name(f) for f in code | data}


def _wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n and not n.endswith("/")}


def test_source_tree_is_what_this_test_expects():
    """Guards the comparison below against comparing nothing."""
    files = source_files()
    pkgs = _source_packages(files)
    assert {"drafttrain", "drafttrain.cache", "draftinfer", "draftinfer.kinds.eagle3"} <= {
        p.replace("/", ".") for p in pkgs
    }
    assert "conf/drafttrain/eagle3.yaml" in files and "conf/draftinfer/infer.yaml" in files
    assert "draftinfer/zoo/llama-tiny/model.safetensors" in files
    assert len([f for f in files if f.startswith("draftinfer/zoo/")]) > 2000


def test_wheel_holds_every_package_preset_and_zoo_file():
    wheel, _ = installed_wheel()
    got, want = _wheel_files(wheel), _expected_files()
    assert not want - got, f"missing from the wheel: {sorted(want - got)[:20]}"
    assert not got - want, f"in the wheel but not in the source packages: {sorted(got - want)[:20]}"
    pkgs = {_installed_name(p) for p in _source_packages(source_files())}
    for pkg in pkgs - {KERNELS}:
        assert f"{pkg}/__init__.py" in got, pkg
    assert {n.split("/")[0] for n in got} == {p.split("/")[0] for p in pkgs}
    yamls = {f for f in got if f.endswith(".yaml")}
    assert {"draftconf/drafttrain/base.yaml", "draftconf/drafttrain/ptd_eagle3.yaml"} <= yamls
    assert {
        "draftconf/drafttrain/drafter/mtp.yaml",
        "draftconf/draftinfer/eval/greedy.yaml",
    } <= yamls
    # The acceptance suites (data, read by `draftinfer.evaluation.suites` from the installed
    # package) and the launcher files.
    assert {
        "draftconf/draftinfer/eval/standard.yaml",
        "draftconf/draftinfer/suite/gsm8k.yaml",
    } <= yamls
    assert {
        "draftconf/launch/accelerate/zero2.yaml",
        "draftconf/launch/deepspeed/zero2.json",
    } <= got
    with zipfile.ZipFile(wheel) as z:
        for name in (
            "draftinfer/zoo/llama-tiny/model.safetensors",
            "draftinfer/zoo/qwen3-vl-tiny/model.safetensors",
        ):
            shipped = hashlib.sha256(z.read(name)).hexdigest()
            assert shipped == hashlib.sha256((REPO / name).read_bytes()).hexdigest(), name


def test_installed_packages_find_presets_and_zoo_from_any_directory(tmp_path):
    _, site = installed_wheel()
    code = """
import json
import drafttrain, drafttrain.cache, draftinfer, draftkernels.runtime, draftbench
from draftinfer.files.paths import ZOO_DIR, resolve_path
from drafttrain.__main__ import CONF_DIR
from draftinfer.__main__ import CONF_DIR as INFER_CONF_DIR
from transformers import AutoConfig, AutoTokenizer

target = resolve_path("zoo:llama-tiny")
print(json.dumps({
    "files": [m.__file__ for m in (drafttrain, drafttrain.cache, draftinfer, draftbench)],
    "kernels": draftkernels.runtime.__file__,
    "dirs": [str(ZOO_DIR), CONF_DIR, INFER_CONF_DIR, target],
    "model_type": AutoConfig.from_pretrained(target).model_type,
    "vocab": len(AutoTokenizer.from_pretrained(target)),
}))
"""
    r = run_installed(["-c", code], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for path in [*got["files"], got["kernels"], *got["dirs"]]:
        assert Path(path).resolve().is_relative_to(site.resolve()), path
        assert Path(path).exists(), path
    assert got["model_type"] == "llama" and got["vocab"] == 4096

    job = run_installed(["-m", "drafttrain", "conf=ptd_eagle3", "--cfg", "job"], cwd=tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "name_or_path: zoo:llama-tiny" in job.stdout and "path: zoo:chat" in job.stdout
    runner = run_installed(["-m", "draftinfer", "--cfg", "job"], cwd=tmp_path)
    assert runner.returncode == 0, runner.stderr[-3000:]
    assert "prompts:" in runner.stdout
    suites = run_installed(
        [
            "-c",
            "from draftinfer.evaluation.suites import SUITE_DIR, load_suite; "
            "print(SUITE_DIR, load_suite('gsm8k').dataset)",
        ],
        cwd=tmp_path,
    )
    assert suites.returncode == 0, suites.stderr[-3000:]
    suite_dir, dataset = suites.stdout.split()
    assert Path(suite_dir).resolve().is_relative_to(site.resolve()) and dataset == "openai/gsm8k"
    assert list(tmp_path.iterdir()) == []  # `--cfg job` composes and writes nothing
