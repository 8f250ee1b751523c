"""The project as a user installs it: the wheel built from the checkout's files and installed
without its dependencies into a folder of its own (what `pip install <wheel>` puts into
site-packages), for tests that run the installed package rather than the checkout (DESIGN 5).

Built once per test process (`installed_wheel()`); `run_installed` runs Python against it from
an empty directory, the installed folder first on the path, so neither the checkout nor an
editable install can stand in for it.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from fnmatch import fnmatch
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a fresh clone lacks, for a checkout that git cannot list (no .git).
NOT_SOURCE = (".git", ".venv", "build", "outputs", "peers", ".whl", "wandb", "*.egg-info")
NOT_SOURCE += ("__pycache__", ".pytest_cache", ".ruff_cache", ".cache")


def source_files() -> list[str]:
    """The checkout's files as a fresh clone has them (git's tracked and not-ignored files), so
    build output or caches lying in the checkout never reach the wheel."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        files = []
        for top, dirs, names in os.walk(REPO):
            dirs[:] = [d for d in dirs if not any(fnmatch(d, pat) for pat in NOT_SOURCE)]
            files += [str((Path(top) / n).relative_to(REPO)) for n in names]
        return files
    return [f for f in out.decode().split("\0") if f and (REPO / f).is_file()]


def _copy_source(dest: Path) -> None:
    for rel in source_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)


@functools.cache
def installed_wheel() -> tuple[Path, Path]:
    """(the wheel file, the folder it is installed in). Built with `pip wheel --no-deps` from a
    copy of the source files (the build backend comes from the package index, as for a user)."""
    root = Path(tempfile.mkdtemp(prefix="drafttrain_wheel_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    src, dist, site = root / "src", root / "dist", root / "site"
    _copy_source(src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-q", "-w", str(dist), str(src)], check=True)
    (wheel,) = dist.glob("drafttrain-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        check=True,
    )
    return wheel, site


def run_installed(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python <args>` in `cwd` with the installed wheel's folder first on the import path."""
    _, site = installed_wheel()
    path = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
