"""Seams: no import circle between our modules, function-local imports included (the rule and
how the graph is read: `tests/import_graph.py`). Dependencies between the packages point one
way: `draftbench -> drafttrain -> draftinfer -> draftkernels`.

One circle is known and left to its fix on main: `drafttrain/train.py` <-> `drafttrain/cache/`
(`train` imports the cache package; the package's `__init__` imports `writer`, whose
`write_cache` imports `drafttrain.train.prepare_data` and `drafttrain.cache.check_family`
inside the function). `test_no_import_circle` exempts exactly that component and nothing else;
`test_known_train_cache_circle` is a strict xfail, so it turns red once the circle is gone:
then delete it and `KNOWN`.
"""

from __future__ import annotations

import pytest

from tests.support.import_graph import PACKAGES, Edge, circles, import_edges, module_files

KNOWN = {"drafttrain.train", "drafttrain.cache", "drafttrain.cache.writer"}
LAYERS = ["draftkernels", "draftinfer", "drafttrain", "draftbench"]  # each imports only lower


def _modules(circle: list[Edge]) -> set[str]:
    return {e.source for e in circle}


def test_graph_reads_our_packages():
    """The checker sees every package and resolves the imports this test depends on."""
    files = module_files()
    assert {m.split(".")[0] for m in files} == set(PACKAGES.values())
    edges = {(e.source, e.target) for e in import_edges()}
    assert ("drafttrain.cache.writer", "drafttrain.train") in edges  # function-local
    assert ("drafttrain.train", "drafttrain.cache") in edges
    assert ("draftinfer.engine", "draftkernels.chain_inputs") in edges


def test_checker_finds_a_function_local_circle(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "draftinfer" / "__init__.py").write_text("")
    (tmp_path / "draftinfer" / "a.py").write_text("from draftinfer import b\n")
    (tmp_path / "draftinfer" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from draftinfer import c\n"
        "def f():\n    from .a import x\n"
    )
    (tmp_path / "draftinfer" / "c.py").write_text("import draftinfer.b\n")
    found = circles(import_edges(tmp_path))
    assert [_modules(c) for c in found] == [{"draftinfer.a", "draftinfer.b"}]


def test_no_import_circle():
    found = [c for c in circles(import_edges()) if _modules(c) != KNOWN]
    assert not found, "import circles:\n" + "\n\n".join("\n".join(map(str, c)) for c in found)


@pytest.mark.xfail(
    strict=True,
    reason="known circle drafttrain/train.py <-> drafttrain/cache/ (function-local imports in "
    "cache/writer.py); fixed on main by the shared job setup, then delete this test and KNOWN",
)
def test_known_train_cache_circle():
    assert KNOWN not in [_modules(c) for c in circles(import_edges())]


def test_packages_import_only_lower_layers():
    bad = [
        str(e)
        for e in import_edges()
        if LAYERS.index(e.target.split(".")[0]) > LAYERS.index(e.source.split(".")[0])
    ]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
