"""The tests' own layout (STYLE rule 14): a test module imports shared helpers from
`tests.support`, never from another test module, and every test lives in an area folder."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_test_module_imports_another():
    bad = [
        f"{p.relative_to(TESTS)} imports {m}"
        for p in TESTS.rglob("*.py")
        for m in _imported_modules(p)
        if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert not bad, "\n".join(bad)


def test_tests_live_in_area_folders():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test modules at the top of tests/ (put them in an area folder): {loose}"
    for p in TESTS.rglob("test_*.py"):
        assert (p.parent / "__init__.py").is_file(), f"{p.parent} is not a package"


def test_every_project_import_in_the_tests_resolves():
    """Imports of our own modules inside test bodies (GPU-only tests included, which never run
    on a CPU machine) name modules and attributes that exist: a helper moved to
    `tests.support` otherwise breaks them unseen until a GPU run."""
    import importlib

    ours = ("tests.", "draftinfer", "drafttrain", "draftbench", "draftkernels")
    bad = []
    for p in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            if not node.module.startswith(ours):
                continue
            where = f"{p.relative_to(TESTS)}:{node.lineno}"
            try:
                mod = importlib.import_module(node.module)
            except ImportError as e:
                bad.append(f"{where}: {e}")
                continue
            for alias in node.names:
                if alias.name == "*" or hasattr(mod, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    bad.append(f"{where}: {node.module} has no {alias.name}")
    assert not bad, "\n".join(bad)
