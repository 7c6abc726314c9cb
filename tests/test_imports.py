"""The package's shape: no import cycle between dagmoe_jax modules (imports inside functions
included: a function-level import is how a cycle hides) and no module over 450 lines.

Read with ``ast`` only (nothing is imported). ``from pkg import name`` counts as an import of
the submodule ``pkg.name`` when that is a module, else of ``pkg`` (its ``__init__``). Optional
heavy dependencies imported lazily (tensorboard, wandb, torch, ...) are not dagmoe_jax modules
and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "dagmoe_jax"
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> Dict[str, Path]:
    """Every module of dagmoe_jax by dotted name (a package by its own name: its __init__)."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve_relative(current: str, is_package: bool, level: int, module: str | None) -> str:
    base = current.split(".")
    if not is_package:
        base = base[:-1]                               # a module's package
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The dagmoe_jax modules ``name`` imports anywhere in its file (top level or not)."""
    found: Set[str] = set()

    def add(target: str) -> None:
        # the longest dagmoe_jax module that is target or a package above it
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dagmoe_jax":
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(name, path.name == "__init__.py", node.level,
                                         node.module)
            else:
                base = node.module or ""
            if base.split(".")[0] != "dagmoe_jax":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else base)
    return found


def import_graph() -> Dict[str, Set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The cycles of ``graph``: in each strongly connected component of more than one module
    (Tarjan), the shortest cycle through each of its modules, [a, b, ..., a], without repeats."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles: List[List[str]] = []
    for component in components:
        members = set(component)
        for start in component:
            cycle = _shortest_cycle(graph, members, start)
            turn = cycle.index(min(cycle[:-1]))            # written from its first module
            cycle = cycle[turn:-1] + cycle[:turn] + [cycle[turn]]
            if cycle not in cycles:
                cycles.append(cycle)
    return cycles


def _shortest_cycle(graph: Dict[str, Set[str]], members: Set[str], start: str) -> List[str]:
    """The shortest way from ``start`` back to itself inside ``members`` (breadth first)."""
    previous: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def test_the_graph_sees_function_level_and_from_imports():
    graph = import_graph()
    # train/__main__.py imports the loop inside main(); `from dagmoe_jax.model import X` is the
    # package; `from dagmoe_jax.upcycle import command` is the submodule.
    assert "dagmoe_jax.train.loop" in graph["dagmoe_jax.train.__main__"]
    assert "dagmoe_jax.upcycle.command" in graph["dagmoe_jax.upcycle.__main__"]
    assert "dagmoe_jax.model" in graph["dagmoe_jax.cli.demo"]
    assert find_cycles({"a": {"b"}, "b": {"c", "a"}, "c": {"b"}, "d": {"a"}}) == [["a", "b", "a"],
                                                                                 ["b", "c", "b"]]


def test_no_import_cycle_between_package_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_over_450_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{path} ({n})" for path, n in long.items())
