"""vllm-project/speculators 0.9.0 in a virtualenv of its own, for the third-party loader tests.

speculators 0.9.0 pins `transformers<=5.19` (and `torch<=2.14.1`, `datasets<=5.1.0`), older
than the project's, so it cannot live in the project's environment. `.ci/run` creates
`.ci-venvs/speculators` (`--system-site-packages`: the project's torch 2.13.0 CPU build and the
rest of its dependencies are shared; `--no-deps` installs of speculators, hs-connectors,
transformers 5.19.0 and what speculators imports at load time). The tests run the speculators
side (`tests/support/speculators_side.py`) with that venv's python in a subprocess.

`SPECULATORS_PYTHON` names another interpreter; without either, the tests skip (and CI, which
always creates the venv, never skips them).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".ci-venvs" / "speculators" / "bin" / "python"
SIDE = Path(__file__).with_name("speculators_side.py")
# What `.ci/run` installs into the venv (`--no-deps`), beside the project's own packages.
PINNED = (
    "speculators==0.9.0",
    "hs-connectors==0.9.0",
    "transformers==5.19.0",
    "loguru==0.7.3",
    "openai==2.0.0",
    "jiter==0.19.0",
)

# Tensors of speculators' models that are its own copies of verifier weights, used only by its
# training loss and filled from the verifier at load; every other tensor must come from the
# folder.
VERIFIER_OWNED = frozenset({"verifier_lm_head.weight", "verifier_norm.weight"})


def speculators_python() -> Path | None:
    """The interpreter that has speculators 0.9.0, or None when there is none here."""
    env = os.environ.get("SPECULATORS_PYTHON")
    if env:
        return Path(env)
    return VENV_PYTHON if VENV_PYTHON.is_file() else None


def run_speculators_side(
    kind: str, speculators_dir: Path, inputs: dict[str, torch.Tensor], work: Path
) -> tuple[dict[str, torch.Tensor], dict]:
    """Run `speculators_side.py KIND FOLDER` with the speculators venv's python from `work` (a
    working directory apart from the export: its recorded verifier must resolve from anywhere);
    -> (tensors it wrote, its metadata). A failure raises with the subprocess's last output."""
    py = speculators_python()
    assert py is not None, "no speculators interpreter"
    work.mkdir(parents=True, exist_ok=True)
    src, out = work / f"{kind}_inputs.safetensors", work / f"{kind}_out.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(src))  # {}: load only
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [str(py), str(SIDE), kind, str(Path(speculators_dir).resolve()), str(src), str(out)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        raise AssertionError(f"speculators side failed ({py}):\n{(r.stdout + r.stderr)[-3000:]}")
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()["info"])
    return load_file(str(out)), meta


def load_speculators_folder(speculators_dir: Path, work: Path) -> dict:
    """Load a speculators folder as written (its own `speculators_model_type`) with no forward;
    -> the side's metadata (versions, verifier, keys not in / unused from the folder)."""
    stype = json.loads((speculators_dir / "config.json").read_text())["speculators_model_type"]
    return run_speculators_side(stype, speculators_dir, {}, work)[1]


def run_peer_bench(name: str, module: str = "peer_speculators", **kwargs) -> dict:
    """`draftbench/<module>.py`'s `name(**kwargs)` (a training-step bench of speculators
    0.9.0's own models) run by the speculators venv's python, this checkout's `draftbench`
    first on its path; -> its result dict."""
    py = speculators_python()
    assert py is not None, "no speculators interpreter"
    code = (
        "import importlib, json, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        f"peer = importlib.import_module('draftbench.{module}')\n"
        f"assert peer.__file__.startswith({str(REPO)!r}), peer.__file__\n"
        "why = peer.available()\n"
        "assert why is None, why\n"
        f"r = peer.{name}(**json.loads(sys.argv[1]))\n"
        "print('RESULT' + json.dumps(r))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [str(py), "-c", code, json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        raise AssertionError(f"peer bench failed ({py}):\n{(r.stdout + r.stderr)[-3000:]}")
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])
