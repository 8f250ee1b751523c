"""The seams hold (DESIGN 2.1): shared code names no drafter kind and reads no kind-specific
attribute; each kind lives in its own folder; dependencies point one way
(`drafttrain -> draftinfer -> kernels`) and the job has no import circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from draftinfer.registry import registered_kinds

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("drafttrain", "draftinfer", "kernels")
# Attributes only a kind's own files may read (the acceptance list of the seams issue, plus
# the other EAGLE-family fields).
KIND_ATTRIBUTES = {
    "parallel",
    "mask_hidden",
    "aux_layer_ids",
    "mask_token_id",
    "parallel_k",
    "ttt_steps",
    "d2t",
    "t2d",
    "fc",
    "project_aux",
}


def _shared_files() -> list[Path]:
    """Python files of the packages outside `kinds/<kind>/` folders."""
    out = []
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).parts
            if "kinds" in parts and parts.index("kinds") < len(parts) - 2:
                continue  # drafttrain/kinds/<kind>/... or draftinfer/kinds/<kind>/...
            out.append(path)
    return out


def test_shared_code_names_no_kind():
    quoted = re.compile("|".join(rf"[\"']{re.escape(k)}[\"']" for k in registered_kinds()))
    hits = []
    for path in _shared_files():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and node.value in registered_kinds():
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
        hits += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in quoted.finditer(text)]
    assert not hits, "kind names in shared code:\n" + "\n".join(hits)


def test_shared_code_reads_no_kind_specific_attribute():
    hits = []
    for path in _shared_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES:
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}")
    assert not hits, "kind-specific attributes in shared code:\n" + "\n".join(hits)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("pkg", ["draftinfer", "kernels"])
def test_dependencies_point_one_way(pkg):
    bad = [
        f"{p.relative_to(REPO)} imports {m}"
        for p in (REPO / pkg).rglob("*.py")
        for m in _imports(p)
        if m.split(".")[0] == "drafttrain"
    ]
    assert not bad, "\n".join(bad)


def test_no_train_export_import_circle():
    assert "drafttrain.train" not in _imports(REPO / "drafttrain" / "export.py")
    assert "drafttrain.export" not in _imports(REPO / "drafttrain" / "train.py")


def test_every_kind_has_its_own_folders():
    for kind in registered_kinds():
        for side in ("draftinfer", "drafttrain"):
            assert (REPO / side / "kinds" / kind / "__init__.py").is_file(), (side, kind)
