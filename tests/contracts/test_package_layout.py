"""The layout the project card promises (DESIGN 2, STYLE rule 20): the top level holds the
packages, `conf/` (the one home of configuration), `scripts/`, `tests/` and `docs/`; a package
root shows its rooms (sub-packages by role) and holds no module but its entry points and its
one registry module; no configuration file lives outside `conf/`."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP = {
    "README.md",
    "pyproject.toml",
    "setup.py",  # package discovery with two renamed folders (its docstring says why)
    "conf",
    "docs",
    "draftbench",
    "draftinfer",
    "drafttrain",
    "kernels",
    "scripts",
    "tests",
}
# Modules a package root may hold: the package marker, entry points, the registry.
ROOT_MODULES = {
    "draftinfer": {"__init__.py", "__main__.py", "registry.py"},
    "drafttrain": {"__init__.py", "__main__.py", "registry.py", "stitch.py"},
}


def _tracked(repo: Path = REPO) -> list[str]:
    import subprocess

    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files"], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:  # not a checkout (an sdist): every file on disk
        return [str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()]
    return [f for f in out.stdout.splitlines() if (repo / f).exists()]


def test_top_level_is_the_cards():
    top = {f.split("/")[0] for f in _tracked() if not f.startswith(".")}
    assert top == TOP, f"extra: {sorted(top - TOP)}, missing: {sorted(TOP - top)}"


def test_package_roots_hold_only_entry_points_and_the_registry():
    for pkg, allowed in ROOT_MODULES.items():
        modules = {p.name for p in (REPO / pkg).glob("*.py")}
        assert modules == allowed, f"{pkg}/: {sorted(modules - allowed)} belong in a room"
        rooms = [p for p in (REPO / pkg).iterdir() if (p / "__init__.py").is_file()]
        for room in rooms:
            doc = (room / "__init__.py").read_text().lstrip()
            assert doc.startswith('"""'), f"{room.relative_to(REPO)} does not say what it holds"


def test_configuration_lives_only_under_conf():
    configs = [f for f in _tracked() if f.endswith((".yaml", ".yml")) and "/zoo/" not in f]
    outside = [f for f in configs if not f.startswith("conf/") and not f.startswith(".")]
    assert configs and not outside, f"config files outside conf/: {outside}"
    assert {"conf/drafttrain", "conf/draftinfer", "conf/launch"} <= {
        "/".join(f.split("/")[:2]) for f in configs
    }
