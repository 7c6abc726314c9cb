"""An offline default text corpus: the docstrings of Python's own standard library.

The quality benchmark needs natural-language text that is on every machine without a download.
The docstrings of the installed CPython standard library are: about 1.5 MB of English technical
prose (module, class and function documentation) written by many authors, read with ``ast``
from the ``.py`` sources (nothing is imported or executed). It is deterministic for a given
Python version, small, and narrow in domain (programming documentation), so absolute
perplexities are not comparable with the paper's (the Pile, Llama-3 tokenizer); the benchmark
compares variants with each other on it.

Held-out text is split by source file, not by paragraph: every ``heldout_every``-th file (in
sorted order) goes to the held-out file, so no module's documentation is on both sides. Test
suites, IDLE, tkinter, lib2to3 and site-packages are left out; docstrings shorter than
``min_chars`` are dropped and exact duplicates kept once (their first occurrence).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
import sysconfig
from pathlib import Path
from typing import List, Tuple

EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                 "tkinter", "turtledemo", "__pycache__")
VERSION = 1  # bump when the extraction changes, so cached files are rebuilt


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
    """Where the corpus files are and what is in them (JSON-able)."""

    train_path: str
    heldout_path: str
    python: str
    files: int
    heldout_files: int
    docstrings: int
    train_bytes: int
    heldout_bytes: int


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_docstrings(source: bytes, min_chars: int) -> List[str]:
    """The module, class and function docstrings of one Python source (``ast``; in the
    order ``ast.walk`` visits them), each with its indentation cleaned (``ast.get_docstring``)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                docs.append(doc.strip())
    return docs


def build_stdlib_corpus(out_dir, *, heldout_every: int = 20, min_chars: int = 40,
                        root: Path | None = None) -> CorpusInfo:
    """Write ``stdlib_docstrings.train.txt`` and ``.heldout.txt`` into ``out_dir`` (reused if
    already built by the same Python and extraction version) and describe them.

    Docstrings are separated by blank lines (a ``text:`` source reads paragraphs as records).
    """
    out = Path(out_dir)
    info_path = out / "stdlib_docstrings.json"
    python = sys.version.split()[0]
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.pop("version", None) == VERSION and info.get("python") == python and all(
                Path(info[k]).exists() for k in ("train_path", "heldout_path")):
            return CorpusInfo(**info)
    root = Path(root) if root is not None else stdlib_root()
    files = sorted(p for p in root.rglob("*.py")
                   if not any(part in EXCLUDED_DIRS for part in p.relative_to(root).parts))
    seen, parts = set(), ([], [])
    for index, path in enumerate(files):
        side = 1 if index % heldout_every == heldout_every - 1 else 0
        for doc in module_docstrings(path.read_bytes(), min_chars):
            if doc not in seen:
                seen.add(doc)
                parts[side].append(doc)
    out.mkdir(parents=True, exist_ok=True)
    train_path = out / "stdlib_docstrings.train.txt"
    heldout_path = out / "stdlib_docstrings.heldout.txt"
    train_path.write_text("\n\n".join(parts[0]) + "\n", encoding="utf-8")
    heldout_path.write_text("\n\n".join(parts[1]) + "\n", encoding="utf-8")
    info = CorpusInfo(train_path=str(train_path), heldout_path=str(heldout_path), python=python,
                      files=len(files), heldout_files=len(files) // heldout_every,
                      docstrings=len(seen), train_bytes=train_path.stat().st_size,
                      heldout_bytes=heldout_path.stat().st_size)
    info_path.write_text(json.dumps({**dataclasses.asdict(info), "version": VERSION}, indent=1))
    return info


def corpus_sources(info: CorpusInfo) -> Tuple[str, str]:
    """(source, eval_source) ``DataConfig`` specs of a built corpus."""
    return f"text:{info.train_path}", f"text:{info.heldout_path}"
