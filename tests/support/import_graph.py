"""The import graph of our packages, read with `ast` (no module is imported), and its circles.

The rule `tests/test_import_graph.py` enforces: no module of `drafttrain/`, `draftinfer/`,
`kernels/` (`draftkernels`) or `draftbench/` imports, directly or through others, a module
that imports it back. A function-local import counts like a module-level one: it hides a
circle from Python until the function runs, it does not remove it.

Edges of the graph, for each module A:
- every `import X` / `from X import n` statement anywhere in A (module level, functions,
  classes, `try` blocks), relative imports resolved; skipped only under `if TYPE_CHECKING:`,
  which never runs. `from P import n` goes to the module `P.n` when there is one, else to `P`;
- importing X also runs the `__init__` of each package that contains X, so A -> X adds
  A -> each such package, except A's own containing packages (already running when A runs);
  an explicit import of one of them (`from drafttrain.cache import f` inside
  `drafttrain/cache/writer.py`) is an edge like any other.
Imports of other distributions are not edges. Dynamic imports (`importlib.import_module`, used
by the kind registries to load `kinds/<kind>/`) are not seen: those registrations are circles
by design (a kind imports the registry that loads it) and are not import statements.

A circle is a strongly connected component of more than one module (Tarjan's algorithm).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# folder in the checkout -> import name
PACKAGES = {
    "drafttrain": "drafttrain",
    "draftinfer": "draftinfer",
    "kernels": "draftkernels",
    "draftbench": "draftbench",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # "path:line" of the import statement

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.where})"


def module_files(repo: Path = REPO) -> dict[str, Path]:
    """Import name -> file, for every Python file of our packages."""
    out = {}
    for folder, name in PACKAGES.items():
        for path in (repo / folder).rglob("*.py"):
            parts = [name, *path.relative_to(repo / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _containing_packages(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Import statements of `tree`, skipping the body of `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _import_nodes(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _import_nodes(node)


def import_edges(repo: Path = REPO) -> list[Edge]:
    files = module_files(repo)

    def ours(name: str) -> str | None:
        """The deepest of our modules `name` names (`a.b.c` -> `a.b` if c is not a module)."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in files:
                return ".".join(parts[:i])
        return None

    edges = []
    for module, path in sorted(files.items()):
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        where = f"{path.relative_to(repo)}:"
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [ours(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else ours(base)
                    for a in node.names
                ]
            mine = set(_containing_packages(module))
            for target in filter(None, targets):
                runs = [target, *(p for p in _containing_packages(target) if p not in mine)]
                edges += [Edge(module, t, where + str(node.lineno)) for t in runs if t != module]
    return edges


def circles(edges: list[Edge]) -> list[list[Edge]]:
    """Each import circle as the edges inside one strongly connected component of more than
    one module (sorted), found with Tarjan's algorithm (iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [
        sorted({e for e in edges if e.source in c and e.target in c}, key=str)
        for c in sorted(components, key=sorted)
    ]
