"""The package's shape: its packages depend downwards only, through four layers (core < data < run
< tools; imports inside functions included: a function-level import is how a cycle hides, and
only commands and optional dependencies may import inside a function), no import cycle between
modules, ``import dagmoe_jax.model`` loads the core only, no module is over 900 lines (450
warns), and no docstring carries a measured figure.

The graph is read with ``ast`` (nothing is imported; one test imports the model in a
subprocess to see what it loads). ``from pkg import name`` counts as an import of
the submodule ``pkg.name`` when that is a module, else of ``pkg`` (its ``__init__``). Optional
heavy dependencies imported lazily (tensorboard, wandb, torch, ...) are not dagmoe_jax modules
and do not count.
"""

from __future__ import annotations

import re

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "dagmoe_jax"
BENCHMARKS = PACKAGE.parent / "benchmarks"
WARN_LINES = 450
"""Above this a module is flagged (a warning in the test report): read it for one idea."""
MAX_LINES = 900
"""Above this a module fails the suite: no single idea of this library needs it."""

# Every top-level unit of the package (a subpackage or a module) with its layer and its rank: a
# unit imports only units of lower rank. Within a layer the ranks say which package sits on which:
# the commands' shared plumbing (stopping < command_line) is below the tools, and the commands of the layers
# below (cli) are the top, which nothing imports.
LAYERS = {
    "core": {"validate": 0, "platform": 0, "config": 1, "kernels": 2, "parallel": 2, "model": 3},
    "data": {"data": 4},
    "run": {"run": 5, "hf": 6, "decoding": 6, "evaluation": 7, "train": 8},
    "tools": {"stopping": 9, "command_line": 10, "analysis": 11, "upcycle": 12, "harness": 12,
              "compile": 12, "cli": 13},
}
RANK = {unit: rank for units in LAYERS.values() for unit, rank in units.items()}
LAYER_OF = {unit: layer for layer, units in LAYERS.items() for unit in units}

# Modules that may import the package inside a function: the commands (their --help must not
# wait for JAX), and the lm-eval adapter, which lm-eval registers before it is asked for a model.
LAZY_IMPORTERS = ("dagmoe_jax.cli", "dagmoe_jax.harness.cli", "dagmoe_jax.harness.lm",
                  "dagmoe_jax.families.doe.command")


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


def imports_of(name: str, path: Path, modules: Dict[str, Path], *,
               in_functions: bool = False) -> Set[str]:
    """The dagmoe_jax modules ``name`` imports anywhere in its file (top level or not; only
    inside functions with ``in_functions``)."""
    found: Set[str] = set()

    def add(target: str) -> None:
        # the longest dagmoe_jax module that is target or a package above it
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    tree = ast.parse(path.read_text(), filename=str(path))
    roots = [tree] if not in_functions else [
        f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes = {id(n): n for root in roots for n in ast.walk(root)}.values()
    for node in nodes:
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
    assert "dagmoe_jax.train.loop" in graph["dagmoe_jax.cli.train"]
    assert "dagmoe_jax.upcycle.command" in graph["dagmoe_jax.upcycle.__main__"]
    assert "dagmoe_jax.model" in graph["dagmoe_jax.cli.demo"]
    assert find_cycles({"a": {"b"}, "b": {"c", "a"}, "c": {"b"}, "d": {"a"}}) == [["a", "b", "a"],
                                                                                 ["b", "c", "b"]]


# A block family's package (dagmoe_jax.families.<kind>) is a vertical slice: each of its modules
# belongs to the unit its name says, so a family's run extension sits in the run layer and its
# command at the top. A new kind of module is placed here before a family may have one.
FAMILY_PARTS = {"config": "config", "budget": "config", "block": "model", "accounting": "model",
                "aggregation": "model", "dag": "model",
                "conversion": "model", "knowledge_blocks": "model", "objective": "model",
                "topics": "data", "extension": "run", "analysis": "analysis", "command": "cli"}


def unit_of(module: str) -> str:
    """The top-level unit of a dagmoe_jax module ('model' for dagmoe_jax.model.routed.router; the
    package's own __init__ is 'config', the only thing it imports); a family's module is in
    the unit of its part (:data:`FAMILY_PARTS`; the families' package docstrings import
    nothing and count as 'config')."""
    parts = module.split(".")
    if parts[1:2] == ["families"]:
        return FAMILY_PARTS[parts[3]] if len(parts) > 3 else "config"
    return parts[1] if len(parts) > 1 else "config"


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in package_modules()}
    assert units == set(RANK), f"units without a layer: {sorted(units - set(RANK))}; " \
                               f"layers naming no unit: {sorted(set(RANK) - units)}"


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """The imports of ``graph`` of a unit of the same or a higher rank (a higher layer, or a
    package beside or above in its own layer), one line each."""
    return sorted(f"{a} ({LAYER_OF[unit_of(a)]}) imports {b} ({LAYER_OF[unit_of(b)]})"
                  for a, targets in graph.items() for b in targets
                  if unit_of(a) != unit_of(b) and RANK[unit_of(b)] >= RANK[unit_of(a)])


def test_packages_depend_downwards_only():
    """No import, at any depth, against the layers."""
    upward = upward_imports(import_graph())
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_only_the_commands_import_the_commands():
    """dagmoe_jax.cli is the top: no module of the package outside it imports it, and no
    benchmark does (the commands' plumbing is dagmoe_jax.command_line, the benchmarks' own
    helpers benchmarks/common.py)."""
    modules = package_modules()
    importers = sorted(f"{name} imports {target}" for name, targets in import_graph().items()
                       if unit_of(name) != "cli"
                       for target in targets if unit_of(target) == "cli")
    for path in sorted(BENCHMARKS.rglob("*.py")):
        name = ".".join(path.relative_to(BENCHMARKS.parent).with_suffix("").parts)
        importers += sorted(f"{path.relative_to(BENCHMARKS.parent)} imports {target}"
                            for target in imports_of(name, path, modules)
                            if unit_of(target) == "cli")
    assert not importers, "\n".join(importers)


def test_the_benchmarks_are_a_package_that_leaves_sys_path_alone():
    """benchmarks/ is imported as a package from the repository root (``python -m
    benchmarks.NAME``, ``import benchmarks.X`` in the tests): no benchmark edits sys.path, and
    every folder of it is a package."""
    edits = sorted(f"{path.relative_to(BENCHMARKS.parent)}:{node.lineno}"
                   for path in sorted(BENCHMARKS.rglob("*.py"))
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Attribute) and node.attr == "path"
                   and isinstance(node.value, ast.Name) and node.value.id == "sys")
    assert not edits, "sys.path used at " + ", ".join(edits)
    folders = {p.parent for p in BENCHMARKS.rglob("*.py")}
    assert all((folder / "__init__.py").is_file() for folder in folders)


def test_the_layer_check_catches_an_upward_import():
    assert upward_imports({"dagmoe_jax.model.routed.router": {"dagmoe_jax.data.pipeline",
                                                       "dagmoe_jax.model.layers"},
                           "dagmoe_jax.run.state": {"dagmoe_jax.train.step"},
                           "dagmoe_jax.train.step": {"dagmoe_jax.run.state"}}) == [
        "dagmoe_jax.model.routed.router (core) imports dagmoe_jax.data.pipeline (data)",
        "dagmoe_jax.run.state (run) imports dagmoe_jax.train.step (run)"]


def test_imports_inside_functions_only_in_commands():
    modules = package_modules()
    lazy = sorted(f"{name} imports {target} inside a function"
                  for name, path in modules.items()
                  if not name.startswith(LAZY_IMPORTERS) and not name.endswith(".__main__")
                  for target in imports_of(name, path, modules, in_functions=True))
    assert not lazy, "\n".join(lazy)


def test_importing_the_model_loads_the_core_only():
    """``import dagmoe_jax.model`` loads nothing of data/, the run layer or the tools; nor does
    building and running a DAG-MoE from a ``ModelConfig`` (docs/library.md's first example,
    run as it is written there)."""
    doc = (PACKAGE.parent / "docs" / "library.md").read_text()
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert "Transformer(cfg, rngs=" in example and "import dagmoe_jax.run" not in example
    for code in ("import dagmoe_jax.model", example + "\nassert logits.shape == (2, 16, 256)"):
        code += ("\nimport json, sys; print(json.dumps(sorted(m for m in sys.modules "
                 "if m.startswith('dagmoe_jax'))))")
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, cwd=PACKAGE.parent, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        loaded = json.loads(out.stdout.strip().splitlines()[-1])
        assert "dagmoe_jax.model.transformer" in loaded
        above = [m for m in loaded if LAYER_OF[unit_of(m)] != "core"]
        assert not above, f"{code.splitlines()[0]}... loads {above}"


def test_importing_the_package_loads_only_the_platform_check():
    """``import dagmoe_jax`` loads the platform check alone (a command's stop handlers come
    right after it); the configs it exports load when first asked for."""
    code = ("import json, sys, dagmoe_jax\n"
            "before = sorted(m for m in sys.modules if m.startswith('dagmoe_jax'))\n"
            "from dagmoe_jax import AggregationConfig, ModelConfig\n"
            "assert ModelConfig(block='coe').block.kind == 'coe'\n"
            "assert AggregationConfig(kind='dag').kind == 'dag'\n"
            "print(json.dumps(before))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=PACKAGE.parent, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["dagmoe_jax", "dagmoe_jax.platform"]


def test_no_import_cycle_between_package_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_module_length_is_a_warning_and_a_far_bound():
    """docs/development.md's cohesion rule (a module is one idea) is for review; length is
    only its symptom: over WARN_LINES a warning names the module, over MAX_LINES it fails."""
    import warnings
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines())
             for p in sorted(PACKAGE.rglob("*.py"))}
    for path, n in sizes.items():
        if WARN_LINES < n <= MAX_LINES:
            warnings.warn(f"{path}: {n} lines; is it still one idea? (docs/development.md)")
    long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{path} ({n})" for path, n in long.items())


MEASURED = re.compile(r"\b\d[\d,.]*\s?(?:ms|s/step|GB/s|GiB|GB|MB|TFLOP/s|tokens/s)\b")


def test_library_docstrings_carry_no_measured_figures():
    """Docstrings state contracts and cite equations; what was measured (times, sizes,
    throughputs) lives in benchmarks/RESULTS.md, where it is dated and reproducible, and a
    docstring cites the section."""
    import ast
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                found += [f"{path.relative_to(PACKAGE.parent)}: {m.group(0)!r}"
                          for m in MEASURED.finditer(doc)]
    assert not found, "measured figures in docstrings: " + "; ".join(found)


def test_every_family_module_has_a_part_and_the_packages_import_nothing():
    """Each module of a family package is a part of :data:`FAMILY_PARTS` (a KeyError in
    unit_of otherwise), and ``dagmoe_jax.families`` and each family's ``__init__`` import
    nothing (importing a family's config must not load its model)."""
    modules = package_modules()
    for name, path in modules.items():
        parts = name.split(".")
        if parts[1:2] != ["families"]:
            continue
        if len(parts) <= 3:
            imported = imports_of(name, path, modules)
            assert not imported, f"{name} imports {sorted(imported)}"
        else:
            assert parts[3] in FAMILY_PARTS, f"{name}: no layer for the part {parts[3]!r}"


def test_every_registered_family_has_its_parts():
    """The registry holds every family package, each with a config, a block (``BLOCK``) and its
    accounting (``layer_counts``, ``grouped_matmul_width``); an extension or analysis a family
    has exports what the run and the analysis ask for."""
    from dagmoe_jax.config import all_families
    packages = {p.name for p in (PACKAGE / "families").iterdir()
                if (p / "__init__.py").is_file()}
    families = all_families()
    assert set(families) == packages
    for kind, family in families.items():
        assert family.package == f"dagmoe_jax.families.{kind}" and family.config.kind == kind
        assert isinstance(family.part("block").BLOCK, type)
        accounting = family.part("accounting")
        assert callable(accounting.layer_counts) and callable(accounting.grouped_matmul_width)
        extension, analysis = family.part("extension"), family.part("analysis")
        assert extension is None or isinstance(extension.EXTENSION, type)
        assert analysis is None or callable(analysis.analyze)
    assert families["dense"].part("extension") is None


def family_branches(source: str, label: str) -> List[str]:
    """The comparisons of a ``kind`` with a block family's name in ``source`` (``cfg.block.kind
    == 'coe'``, ``block.kind != "dense"``), as ``label:line``: a branch on the family, which
    belongs in the family's package."""
    from dagmoe_jax.config import KINDS
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        kinds = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "kind"]
        names = [s for s in sides if isinstance(s, ast.Constant) and s.value in KINDS]
        if kinds and names:
            found.append(f"{label}:{node.lineno}")
    return found


def test_no_branch_on_a_block_family_outside_its_package():
    """No module of the library outside dagmoe_jax/families, and no benchmark, compares a
    ``kind`` with a family's name: a layer asks the family (the registry's parts, the config's
    ``label``, ``describe()``, ``hf_family``, :func:`~dagmoe_jax.config.experts_of` and the
    other questions of dagmoe_jax.config.blocks) or requires a family's config class."""
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if "families" not in p.parts]
    branches = [b for p in paths + sorted(BENCHMARKS.rglob("*.py"))
                for b in family_branches(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert not branches, "branches on a block family: " + ", ".join(branches)
    assert family_branches("def f(cfg):\n    return cfg.block.kind == 'coe'\n", "f") == ["f:2"]
    assert family_branches("def f(a):\n    return a.kind == 'sum'\n", "f") == []
