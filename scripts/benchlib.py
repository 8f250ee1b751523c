"""Helpers shared by the benchmark scripts (run as `python scripts/bench_*.py`)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_kernel(name: str):
    """`draftkernels.<name>`, also from a checkout that is not pip-installed (the `kernels/`
    folder is installed under the import name `draftkernels`)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if importlib.util.find_spec("draftkernels") is None:
        pkg = types.ModuleType("draftkernels")
        pkg.__path__ = [str(REPO / "kernels")]
        sys.modules["draftkernels"] = pkg
    return importlib.import_module(f"draftkernels.{name}")


def print_table(rows: list[dict], cols: list[tuple[str, int]]) -> None:
    """Right-aligned columns (name, width); floats with one decimal."""
    print(" ".join(f"{name:>{w}}" for name, w in cols))
    for r in rows:
        cells = []
        for name, w in cols:
            v = r[name]
            cells.append(f"{v:>{w}.1f}" if isinstance(v, float) else f"{v!s:>{w}}")
        print(" ".join(cells))
