"""The house's layering (docs/architecture.md, "Layers"): the import-linter contracts of pyproject.toml hold,
and no import cycle joins modules of runners, evals, registry, kernels and benchmarks.

import-linter's `layers` contract forbids an import up a layer, but a circle inside one layer (two modules of
evals importing each other, even lazily) passes it; the cycle check reads the same import graph (grimp,
import-linter's graph library: every import statement, function-level ones and those under
``if TYPE_CHECKING:`` included) and names each cycle.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from registry.schema import REPO_ROOT

# the `test` extra installs it (import-linter's graph library); the GPU machine's image has neither
grimp = pytest.importorskip("grimp", reason="import-linter is not installed (pip install '.[test]')")

PACKAGES = ("runners", "evals", "registry", "kernels", "benchmarks")


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a module graph: its strongly connected components of more than one module (and
    modules that import themselves), each as its sorted modules; sorted.

    edges: {module: the modules it imports directly}. Tarjan's algorithm (R. Tarjan, "Depth-first search and
    linear graph algorithms", SIAM J. Comput. 1972), iterative so a deep graph cannot exhaust the recursion
    limit. Returns [] for an acyclic graph.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1 or node in edges.get(node, ()):
                    components.append(sorted(comp))
    return sorted(components)


def cycle_through(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One cycle of a strongly connected component, from its first module back to it (breadth-first, so the
    shortest), e.g. [a, b, a]: what a failure message shows."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for w in sorted(edges.get(m, ())):
                if w == start:
                    path = [m]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in parent:
                    parent[w] = m
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")  # Tarjan's components always are


def module_graph() -> dict[str, set[str]]:
    """{module: modules of PACKAGES it imports directly} for every module of PACKAGES (grimp). Imports under
    ``if TYPE_CHECKING:`` count too: they never run, but a module that names another in its annotations
    depends on it by design, and a circle of such dependencies is the tangle this check is for (the
    scheduler once drove the engine it was imported by, naming ``Engine`` only under TYPE_CHECKING)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    graph = grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=False)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_import_cycles_finds_and_names_a_cycle():
    edges = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert import_cycles(edges) == [["a", "b", "c"], ["e"]]
    assert [cycle_through(c, edges) for c in import_cycles(edges)] == [["a", "b", "c", "a"], ["e", "e"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_a_cycle_through_type_checking_imports_is_found(tmp_path, monkeypatch):
    """A cycle whose one edge sits under ``if TYPE_CHECKING:`` (the engine / scheduler shape) is a cycle."""
    pkg = tmp_path / "tcpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("from tcpkg.scheduler import Scheduler\n")
    (pkg / "scheduler.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from tcpkg.engine import Engine\nclass Scheduler: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("tcpkg", cache_dir=None, exclude_type_checking_imports=False)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert import_cycles(edges) == [["tcpkg.engine", "tcpkg.scheduler"]]


def test_no_import_cycle_between_modules():
    edges = module_graph()
    cycles = import_cycles(edges)
    fix = "break each: move what both ends need into a module below them"
    assert not cycles, f"import cycles ({fix}):\n" + "\n".join(
        f"{', '.join(c)}; e.g. {' -> '.join(cycle_through(c, edges))}" for c in cycles)


def test_import_linter_contracts_hold():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install '.[test]' (import-linter)")
    proc = subprocess.run([exe, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
