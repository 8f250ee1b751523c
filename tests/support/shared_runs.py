"""Training fixtures shared by every process of a test session.

Under pytest-xdist (`-n 2` in `pyproject.toml`: the README's `python -m pytest` runs two
worker processes) a session fixture is built once per worker. A fixture that trains a drafter
(the zoo recipe per kind, a preset's short recipe) would then train twice; `shared_run` builds
it once per session instead: the first process to ask trains under a file lock and writes the
summary; the others wait for the lock and read it. The runs live under the session's shared
temporary root, which xdist gives its workers in common (`getbasetemp().parent`), so nothing
survives the session.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def session_root(tmp_path_factory) -> Path:
    """The temporary folder every process of this session sees: the base temp dir itself
    without xdist, its parent (the session's root, shared by the workers) under it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(tmp_path_factory, name: str, build: Callable[[Path], dict]) -> dict:
    """`build(out_dir)` run once per session (across xdist workers) for `name`; its result
    (a picklable job summary) read back by every later caller."""
    root = session_root(tmp_path_factory) / "shared_runs"
    root.mkdir(parents=True, exist_ok=True)
    out, done = root / name, root / f"{name}.pkl"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            out.mkdir(exist_ok=True)
            result = build(out)
            tmp = done.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(result))
            tmp.replace(done)
    return pickle.loads(done.read_bytes())
