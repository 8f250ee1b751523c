"""DESIGN section 5: our `kernels/` folder must never be picked up as Hugging Face's
hub-kernels library (import name `kernels`), which transformers probes for: not from the
checkout (editable install, the repository root as working directory) and not from the
installed wheel (`tests/wheel_install.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.wheel_install import installed_wheel, run_installed

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, cwd: Path, env_extra: dict[str, str] | None = None) -> str:
    import os

    env = {**os.environ, **(env_extra or {})}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_our_kernels_install_as_draftkernels():
    import draftkernels.runtime

    assert Path(draftkernels.runtime.__file__).resolve() == REPO / "kernels" / "runtime.py"
    assert not (REPO / "kernels" / "__init__.py").exists()


def test_transformers_does_not_see_our_kernels_from_repo_root():
    out = _run(
        """
        from transformers.utils import is_kernels_available
        print(is_kernels_available())
    """,
        cwd=REPO,
    )
    assert out == "False"


def test_real_hub_kernels_package_wins_over_our_folder(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "__version__ = '0.0.fake'\ndef get_kernel(name):\n    return name\n"
    )
    out = _run(
        """
        import kernels, draftkernels.runtime
        print(kernels.__file__)
        print(kernels.get_kernel('x'))
    """,
        cwd=REPO,
        env_extra={"PYTHONPATH": str(tmp_path / "site")},
    )
    first, second = out.splitlines()
    assert first == str(fake / "__init__.py") and second == "x"


@pytest.mark.slow
def test_installed_wheel_has_draftkernels_and_no_kernels(tmp_path):
    _, site = installed_wheel()
    assert (site / "draftkernels" / "runtime.py").is_file()
    assert not (site / "kernels").exists()
    code = """
import importlib.metadata, importlib.util, json
import draftkernels.runtime
from transformers.utils import is_kernels_available
spec = importlib.util.find_spec("kernels")
try:
    importlib.metadata.version("kernels")
    hub_kernels = True
except importlib.metadata.PackageNotFoundError:
    hub_kernels = False
print(json.dumps({
    "ours": draftkernels.runtime.__file__,
    "kernels": None if spec is None else [spec.origin, *(spec.submodule_search_locations or [])],
    "hub_kernels_installed": hub_kernels,
    "transformers_sees_kernels": is_kernels_available(),
}))
"""
    r = run_installed(["-c", code], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["ours"]).resolve() == (site / "draftkernels" / "runtime.py").resolve()
    for location in got["kernels"] or []:  # only a real hub-kernels install may answer
        assert location is None or site.resolve() not in Path(location).resolve().parents
    assert got["transformers_sees_kernels"] == got["hub_kernels_installed"]


def test_pdl_environment_switch_turns_both_on_at_import():
    """`DRAFTKERNELS_PDL=1` (docs/inference.md) turns programmatic dependent launch on for our
    kernels and inductor's at import; unset, both stay off."""
    code = """
        import torch._inductor.config as c
        import draftkernels.runtime as r
        print(r.PDL["on"], c.triton.enable_pdl)
    """
    assert _run(code, REPO, {"DRAFTKERNELS_PDL": "1"}) == "True True"
    assert (
        _run(code, REPO, {"DRAFTKERNELS_PDL": "0", "TORCHINDUCTOR_ENABLE_PDL": "0"})
        == "False False"
    )
