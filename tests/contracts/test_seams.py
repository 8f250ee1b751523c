"""The seams hold (DESIGN 2.1): shared code names no drafter kind and reads no kind-specific
attribute, code outside a target family's folders names no family and touches no
family-specific input or attribute; each kind and each family lives in its own folders,
registered on both sides under the same names; dependencies point one way
(`drafttrain -> draftinfer -> kernels`) and the job has no import circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from draftinfer.registry import DEFAULT_FAMILY, registered_families, registered_kinds

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


# Inputs and attributes only a target family's own files may touch (Qwen3-VL's vision inputs,
# DeepStack and M-RoPE delta bookkeeping); shared code sees them as `TargetInputs.extra`,
# `TargetOutput.mm_mask` and `Slots.rope_pos`.
FAMILY_ATTRIBUTES = {
    "deepstack",
    "num_deepstack",
    "image_token_id",
    "video_token_id",
    "vision_config",
    "visual",
    "encode_images",
    "set_mrope_delta",
    "mrope_delta",
    "rope_index",
}
FAMILY_KEYS = {"pixel_values", "image_grid_thw", "mm_token_type_ids", "image_rows"}


def _files_outside(folder: str) -> list[Path]:
    """Python files of the packages outside `<folder>/<name>/` folders (a kind's or a
    family's own files)."""
    out = []
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).parts
            if folder in parts and parts.index(folder) < len(parts) - 2:
                continue  # e.g. drafttrain/kinds/<kind>/... or draftinfer/families/<family>/...
            out.append(path)
    return out


def _shared_files() -> list[Path]:
    """Python files outside `kinds/<kind>/` folders."""
    return _files_outside("kinds")


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


def test_code_outside_families_names_no_family():
    """No family name (the default family aside: it is the fallback by name) as a string, and
    no family-specific attribute or input key, outside `families/<family>/` folders (kinds
    included: a kind meets a family only through declared capabilities)."""
    names = set(registered_families()) - {DEFAULT_FAMILY}
    hits = []
    # drafttrain/zoo/ builds the shipped zoo targets, each of a named family by design (a
    # Llama, a Qwen3-VL); it is a tool beside the training and serving path, not shared code.
    zoo = REPO / "drafttrain" / "zoo"
    for path in _files_outside("families"):
        if zoo in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and node.value in names | FAMILY_KEYS:
                hits.append(f"{where}: {node.value!r}")
            if isinstance(node, ast.Attribute) and node.attr in FAMILY_ATTRIBUTES:
                hits.append(f"{where}: .{node.attr}")
    assert not hits, "family-specific names outside the family folders:\n" + "\n".join(hits)


def test_both_family_registries_name_the_same_families():
    from drafttrain.registry import TRAIN_FAMILIES

    assert sorted(TRAIN_FAMILIES.load()) == registered_families()
    assert DEFAULT_FAMILY in registered_families()


def test_every_family_has_its_own_folders():
    for family in registered_families():
        for side in ("draftinfer", "drafttrain"):
            assert (REPO / side / "families" / family / "__init__.py").is_file(), (side, family)


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
    export = REPO / "drafttrain" / "export" / "directory.py"
    assert export.is_file() and "drafttrain.jobs.train" not in _imports(export)
    train = REPO / "drafttrain" / "jobs" / "train.py"
    assert train.is_file() and "drafttrain.export.directory" not in _imports(train)


def test_every_kind_has_its_own_folders():
    for kind in registered_kinds():
        for side in ("draftinfer", "drafttrain"):
            assert (REPO / side / "kinds" / kind / "__init__.py").is_file(), (side, kind)
