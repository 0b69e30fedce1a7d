"""No import cycles between the project's modules, read from the sources (nothing is imported).

Every ``import`` counts: at module level, inside functions and under ``if TYPE_CHECKING:`` (a lazy
import hides a cycle from the interpreter, not from a reader: the two modules still need each
other). Edges go between modules of the project's own packages only. ``from pkg import name`` is an
edge to the submodule ``pkg.name`` when there is one, else to ``pkg`` (a package is its
``__init__``), so a package ``__init__`` that re-exports a submodule which imports from the package
is a cycle too: submodules import each other directly.

A cycle is a strongly connected component of more than one module; the failure names each one, a
shortest cycle through it, and the file and line of each import inside it.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = (
    "boogu_schedule",
    "boogu_data",
    "boogu_adapters",
    "boogu_trainer",
    "boogu_tiny",
    "boogu_dryrun",
    "boogu_protocol",
    "boogu_vllm",
)


@dataclass(frozen=True)
class ImportSite:
    """One import statement's edge: ``importer`` imports ``imported`` at ``path:line``."""

    importer: str
    imported: str
    path: Path
    line: int


def module_files(src_roots: Iterable[Path], packages: Iterable[str]) -> dict[str, Path]:
    """Module name -> source file for every module of ``packages`` under the ``src`` roots
    (``pkg/__init__.py`` is the module ``pkg``)."""
    wanted = set(packages)
    modules: dict[str, Path] = {}
    for root in src_roots:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[0] not in wanted:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """``name`` if it is a module, else its longest prefix that is one (``pkg.attr`` -> ``pkg``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> Iterable[tuple[str, int]]:
    """``(imported module, line)`` for every import in ``path`` of a module in ``modules``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):  # every import: module level, in functions, under TYPE_CHECKING
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is this module's package, each more one up
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if alias.name != "*" and sub in modules else _known(base, modules)
                if target is not None:
                    yield target, node.lineno


def import_graph(modules: Mapping[str, Path]) -> dict[str, list[ImportSite]]:
    """Importer -> its import sites of other modules in ``modules`` (self-imports left out)."""
    graph: dict[str, list[ImportSite]] = {}
    for module, path in modules.items():
        found = dict.fromkeys(_imports_of(module, path, modules))  # `from m import a, b`: one edge
        graph[module] = [ImportSite(module, target, path, line) for target, line in found if target != module]
    return graph


def strongly_connected_components(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components, each sorted, in sorted order."""
    succ = {v: sorted(set(ws)) for v, ws in edges.items()}
    for ws in list(succ.values()):
        for w in ws:
            succ.setdefault(w, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                components.append(sorted(component))
            if work:  # v is done: its low link flows to the caller
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return sorted(components)


def import_cycles(graph: Mapping[str, list[ImportSite]]) -> list[list[str]]:
    """The strongly connected components of more than one module: each is (at least) one cycle."""
    edges = {v: [s.imported for s in sites] for v, sites in graph.items()}
    return [c for c in strongly_connected_components(edges) if len(c) > 1]


def _shortest_cycle(component: list[str], edges: Mapping[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first inside the component)."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(edges[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{component} is not a cycle")


def describe_cycles(graph: Mapping[str, list[ImportSite]], root: Path) -> str:
    """The failure message: each cycle's modules, a shortest cycle, and its import sites."""
    edges = {v: {s.imported for s in sites} for v, sites in graph.items()}
    lines = []
    for component in import_cycles(graph):
        members = set(component)
        lines.append(f"import cycle: {' -> '.join(_shortest_cycle(component, edges))}")
        if len(component) > 2:
            lines.append(f"  (all of {', '.join(component)} import each other, directly or not)")
        for v in component:
            for site in graph[v]:
                if site.imported in members:
                    where = site.path.relative_to(root) if site.path.is_relative_to(root) else site.path
                    lines.append(f"  {where}:{site.line}: {site.importer} imports {site.imported}")
    return "\n".join(lines)


def project_graph() -> dict[str, list[ImportSite]]:
    return import_graph(module_files(sorted((ROOT / "packages").glob("*/src")), PROJECT_PACKAGES))


def test_no_import_cycles():
    graph = project_graph()
    assert len(graph) > 50 and "boogu_trainer.trainer" in graph, sorted(graph)  # the sources were found
    cycles = import_cycles(graph)
    assert not cycles, (
        f"{len(cycles)} import cycle(s) between the project's modules; break each (move what both need "
        "into a module below them, or import the submodule directly instead of its package):\n"
        + describe_cycles(graph, ROOT)
    )


# ---------------------------------------------------------------------------------------------
# The graph functions on small synthetic trees, so that the test above cannot pass vacuously.


def _tree(tmp_path: Path, files: Mapping[str, str]) -> dict[str, list[ImportSite]]:
    src = tmp_path / "packages" / "alpha-dist" / "src"
    for name, text in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return import_graph(module_files([src], ("alpha", "beta")))


def test_an_acyclic_tree_has_no_cycles(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "alpha/__init__.py": "from alpha.low import f\nfrom alpha.high import g\n",
            "alpha/low.py": "import os\nimport torch\n\ndef f(): ...\n",
            "alpha/high.py": "from alpha.low import f\nfrom beta import h\n\ndef g(): ...\n",
            "beta/__init__.py": "from beta.core import h\n",
            "beta/core.py": "import alpha.low\n\ndef h(): ...\n",
            "gamma/__init__.py": "import alpha\n",  # not a project package: left out
        },
    )
    edges = {v: sorted(s.imported for s in sites) for v, sites in graph.items()}
    assert edges == {
        "alpha": ["alpha.high", "alpha.low"],
        "alpha.low": [],
        "alpha.high": ["alpha.low", "beta"],
        "beta": ["beta.core"],
        "beta.core": ["alpha.low"],
    }
    assert import_cycles(graph) == []


def test_function_level_and_type_checking_imports_make_a_cycle(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "alpha/__init__.py": "",
            "alpha/a.py": "def f():\n    from alpha.b import g\n    return g()\n",
            "alpha/b.py": (
                "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from alpha.a import f\n\ndef g(): ...\n"
            ),
        },
    )
    assert import_cycles(graph) == [["alpha.a", "alpha.b"]]
    message = describe_cycles(graph, tmp_path)
    assert "import cycle: alpha.a -> alpha.b -> alpha.a" in message
    assert "alpha/a.py:2: alpha.a imports alpha.b" in message
    assert "alpha/b.py:4: alpha.b imports alpha.a" in message


def test_relative_imports_resolve_to_the_module(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "alpha/__init__.py": "",
            "alpha/sub/__init__.py": "from . import x\n",  # the submodule alpha.sub.x
            "alpha/sub/x.py": "from .y import thing\n",
            "alpha/sub/y.py": "from ..top import helper\n\nthing = 1\n",
            "alpha/top.py": "from .sub import x\n\ndef helper(): ...\n",  # alpha.sub.x, not alpha.sub
        },
    )
    edges = {v: sorted(s.imported for s in sites) for v, sites in graph.items()}
    assert edges["alpha.sub"] == ["alpha.sub.x"]
    assert edges["alpha.sub.x"] == ["alpha.sub.y"]
    assert edges["alpha.sub.y"] == ["alpha.top"]
    assert edges["alpha.top"] == ["alpha.sub.x"]
    assert import_cycles(graph) == [["alpha.sub.x", "alpha.sub.y", "alpha.top"]]
    assert "import cycle: alpha.sub.x -> alpha.sub.y -> alpha.top -> alpha.sub.x" in describe_cycles(
        graph, tmp_path
    )


def test_a_submodule_importing_its_reexporting_package_is_a_cycle(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "alpha/__init__.py": "",
            "alpha/config/__init__.py": "from alpha.config.loader import load\nfrom alpha.config.sections import S\n",
            "alpha/config/sections.py": "class S: ...\n",
            "alpha/config/loader.py": "from alpha.config import S\n\ndef load(): ...\n",  # via the package
        },
    )
    assert import_cycles(graph) == [["alpha.config", "alpha.config.loader"]]
    # Importing the sibling directly is no cycle.
    fixed = _tree(tmp_path, {"alpha/config/loader.py": "from alpha.config.sections import S\n"})
    assert import_cycles(fixed) == []


def test_components_are_found_in_a_larger_graph():
    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d"], "f": ["a"], "g": []}
    assert strongly_connected_components(edges) == [["a", "b", "c"], ["d", "e"], ["f"], ["g"]]
