"""Seams: no import circle between our modules, function-local imports included (the rule and
how the graph is read: `tests/support/import_graph.py`). Dependencies between the packages
point one way: `draftbench -> drafttrain -> draftinfer -> draftkernels`.

The jobs share one setup without a circle: `drafttrain.jobs.train`, `drafttrain.cache.writer` and
`drafttrain.regenerate.job` import `drafttrain.jobs.setup`, which opens a feature source through
the registry of `drafttrain.sources` (a feature cache through `drafttrain.cache.reader`); the
cache package does not import its writer.
"""

from __future__ import annotations

from tests.support.import_graph import PACKAGES, Edge, circles, import_edges, module_files

LAYERS = ["draftkernels", "draftinfer", "drafttrain", "draftbench"]  # each imports only lower


def _modules(circle: list[Edge]) -> set[str]:
    return {e.source for e in circle}


def test_graph_reads_our_packages():
    """The checker sees every package and resolves the imports this test depends on."""
    files = module_files()
    assert {m.split(".")[0] for m in files} == set(PACKAGES.values())
    edges = {(e.source, e.target) for e in import_edges()}
    assert ("drafttrain.cache.__main__", "drafttrain.cache.writer") in edges  # function-local
    assert ("drafttrain.regenerate", "drafttrain.regenerate.job") in edges  # function-local
    for job in ("drafttrain.jobs.train", "drafttrain.cache.writer", "drafttrain.regenerate.job"):
        assert (job, "drafttrain.jobs.setup") in edges, job
    assert ("drafttrain.jobs.setup", "drafttrain.sources") in edges
    assert ("drafttrain.sources.stored", "drafttrain.cache.reader") in edges
    assert ("drafttrain.sources.stored", "drafttrain.cache") in edges  # the package's __init__ runs
    assert ("draftinfer.decoding.engine", "draftkernels.chain_inputs") in edges


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
    found = circles(import_edges())
    assert not found, "import circles:\n" + "\n\n".join("\n".join(map(str, c)) for c in found)


def test_packages_import_only_lower_layers():
    bad = [
        str(e)
        for e in import_edges()
        if LAYERS.index(e.target.split(".")[0]) > LAYERS.index(e.source.split(".")[0])
    ]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
