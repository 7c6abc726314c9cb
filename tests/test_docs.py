"""The documents describe the code as it is: every module, file or folder they name exists.

Read from the text only (nothing is imported): a dotted name ``dagmoe_jax.a.b.name`` must be a
module of the package, or a name defined or imported in the module (or package ``__init__``) it
ends in; a path ``dagmoe_jax/...``, ``benchmarks/...``, ``tests/...``, ``configs/...``,
``docs/...`` or ``notebooks/...`` must exist; and design.md's layout (section 11) lists every
module and package under ``dagmoe_jax/``, each of which must exist.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"),
                    REPO / "benchmarks" / "RESULTS.md"])
DOTTED = re.compile(r"\bdagmoe_jax(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
PATH = re.compile(r"(?<![\w/.])(?:dagmoe_jax|benchmarks|tests|configs|docs|notebooks)/[\w./*-]*[\w/*]")
# A module named from inside the package (design.md's `model/settle.py`).
UNITS = sorted(p.name for p in (REPO / "dagmoe_jax").iterdir() if (p / "__init__.py").exists())
INNER = re.compile(rf"(?<![\w/.])(?:{'|'.join(UNITS)})/[\w/]*\.py\b")
# Where an installed package keeps what a checkout keeps elsewhere (pyproject.toml's package-dir).
INSTALLED = {"dagmoe_jax/configs": "configs"}


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", path.read_text()) is not None


def _exists(path: str) -> bool:
    return any(REPO.glob(path)) if "*" in path else (REPO / path).exists()


def dotted_problem(dotted: str) -> str:
    """'' when ``dotted`` names a module of the package or a name in one; else what is wrong."""
    parts = dotted.split(".")
    here = REPO / parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if (here / part).is_dir() and (here / part / "__init__.py").exists():
            here = here / part
        elif (here / f"{part}.py").exists():
            module = here / f"{part}.py"
            rest = parts[i + 1:]
            if rest and not _defines(module, rest[0]):
                return f"{dotted}: {'.'.join(parts[:i + 1])} has no {rest[0]}"
            return ""
        else:
            init = here / "__init__.py"
            if init.exists() and _defines(init, part) and part[0] != "_":
                return ""
            return f"{dotted}: no module or name {'.'.join(parts[:i + 1])}"
    return ""


def broken_references(text: str) -> List[str]:
    problems = [p for d in sorted(set(DOTTED.findall(text))) if (p := dotted_problem(d))]
    problems += [f"{p}: no such path" for p in sorted(set(PATH.findall(text)))
                 if not _exists(INSTALLED.get(p.rstrip("/."), p.rstrip("/.")))]
    problems += [f"{p}: no such module in dagmoe_jax/" for p in sorted(set(INNER.findall(text)))
                 if not (REPO / "dagmoe_jax" / p).exists()]
    return problems


def layout_entries(design: str) -> List[str]:
    """The modules and packages section 11 of design.md lists under dagmoe_jax/, as paths
    relative to it (``families/moe/dag/``, ``families/moe/dag/equations.py``): a name at two
    spaces is a top-level unit, at four a module or package of the unit above, at six and eight one of the
    package above that; a description's continuation lines are indented further."""
    block = design.split("## 11. Repository layout", 1)[1].split("```")[3]
    entries, inside, parents = [], False, {}
    for line in block.splitlines():
        if line.startswith("dagmoe_jax/"):
            inside = True
            continue
        if inside and line and not line.startswith(" "):
            break
        match = re.match(r"^( {2}| {4}| {6}| {8})(\S+)", line) if inside else None
        if not match:
            continue
        depth, name = len(match.group(1)) // 2, match.group(2)
        parent = parents.get(depth - 1, "") if depth > 1 else ""
        path = parent + (name if name.endswith(("/", ".py")) else name + ".py")
        parents[depth] = path if path.endswith("/") else parents.get(depth, "")
        entries.append(path)
    return entries


def package_units(root: Path = REPO / "dagmoe_jax") -> List[str]:
    """Every module (``__init__.py`` apart) and package of dagmoe_jax, relative to it."""
    units = [f"{p.relative_to(root)}" for p in root.rglob("*.py") if p.name != "__init__.py"]
    units += [f"{p.parent.relative_to(root)}/" for p in root.rglob("__init__.py")
              if p.parent != root]
    return sorted(units)


def test_every_reference_in_the_documents_exists():
    problems = [f"{doc.relative_to(REPO)}: {p}" for doc in DOCUMENTS
                for p in broken_references(doc.read_text())]
    assert not problems, "\n".join(problems)


def test_the_layout_lists_what_is_there():
    """design.md's layout names every module and package of dagmoe_jax, and nothing else."""
    entries = layout_entries((REPO / "docs" / "design.md").read_text())
    assert {"model/", "model/routed/", "families/moe/dag/", "families/moe/dag/equations.py",
            "validate.py"} <= set(entries)
    missing = [e for e in entries if not (REPO / "dagmoe_jax" / e.rstrip("/")).exists()]
    assert not missing, f"design.md's layout names what does not exist: {missing}"
    unlisted = sorted(set(package_units()) - set(entries))
    assert not unlisted, f"design.md's layout leaves out {unlisted}"
    assert len(entries) == len(set(entries)), "design.md's layout names a module twice"


def test_the_layout_check_reads_nesting_and_catches_a_stale_module():
    design = ("## 11. Repository layout\n```\nlayers\n```\n\n```\ndagmoe_jax/\n"
              "  validate.py   checks\n  model/        the modules\n"
              "    settle      settling, described\n                  on two lines\n"
              "    routed/     the routed parts\n      router      the router\n"
              "    lifecycle   gone\ntrain.py  the command\n```\n")
    entries = layout_entries(design)
    assert entries == ["validate.py", "model/", "model/settle.py", "model/routed/",
                       "model/routed/router.py", "model/lifecycle.py"]
    assert [e for e in entries if not (REPO / "dagmoe_jax" / e.rstrip("/")).exists()] == [
        "model/lifecycle.py"]


def test_the_checks_catch_a_stale_name():
    assert broken_references("see `dagmoe_jax.lifecycle.settle`, dagmoe_jax/gin_utils.py and "
                             "`upcycle/hf_llama.py`, not `model/settle.py`") == [
        "dagmoe_jax.lifecycle.settle: no module or name dagmoe_jax.lifecycle",
        "dagmoe_jax/gin_utils.py: no such path",
        "upcycle/hf_llama.py: no such module in dagmoe_jax/"]
    assert dotted_problem("dagmoe_jax.model.settle.no_such_function").endswith("has no no_such_function")
    assert dotted_problem("dagmoe_jax.model.settle.settle") == ""
    assert dotted_problem("dagmoe_jax.model.Transformer") == ""
