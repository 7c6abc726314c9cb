"""Offline text corpora: the docstrings of Python's standard library, and the manual pages.

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

A second corpus for results that should not hang on one domain: the English manual pages
installed under ``/usr/share/man`` (sections 1, 5, 7 and 8: commands, file formats,
overviews, administration), troff markup stripped by :func:`troff_to_text`, split by page the
same way. Its size depends on what the machine has installed (the builder reports it).
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import json
import re
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Iterable, List, Tuple

EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                 "tkinter", "turtledemo", "__pycache__")
VERSION = 2  # bump when the extraction changes, so cached files are rebuilt


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


def _write_corpus(out: Path, name: str, origin: str, files: List[Path],
                  extract: Callable[[Path], Iterable[str]], heldout_every: int) -> CorpusInfo:
    """Split ``files`` (every ``heldout_every``-th held out), extract their texts, drop exact
    duplicates and write ``name.train.txt`` / ``name.heldout.txt`` (texts separated by blank
    lines, which a ``text:`` source reads as records) and ``name.json``."""
    seen, parts = set(), ([], [])
    for index, path in enumerate(files):
        side = 1 if index % heldout_every == heldout_every - 1 else 0
        for doc in extract(path):
            if doc not in seen:
                seen.add(doc)
                parts[side].append(doc)
    out.mkdir(parents=True, exist_ok=True)
    train_path = out / f"{name}.train.txt"
    heldout_path = out / f"{name}.heldout.txt"
    train_path.write_text("\n\n".join(parts[0]) + "\n", encoding="utf-8")
    heldout_path.write_text("\n\n".join(parts[1]) + "\n", encoding="utf-8")
    info = CorpusInfo(train_path=str(train_path), heldout_path=str(heldout_path), python=origin,
                      files=len(files), heldout_files=len(files) // heldout_every,
                      docstrings=len(seen), train_bytes=train_path.stat().st_size,
                      heldout_bytes=heldout_path.stat().st_size)
    (out / f"{name}.json").write_text(json.dumps({**dataclasses.asdict(info),
                                                  "version": VERSION}, indent=1))
    return info


def _cached(out: Path, name: str, origin: str):
    info_path = out / f"{name}.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.pop("version", None) == VERSION and info.get("python") == origin and all(
                Path(info[k]).exists() for k in ("train_path", "heldout_path")):
            return CorpusInfo(**info)
    return None


def build_stdlib_corpus(out_dir, *, heldout_every: int = 20, min_chars: int = 40,
                        root: Path | None = None) -> CorpusInfo:
    """Write ``stdlib_docstrings.train.txt`` and ``.heldout.txt`` into ``out_dir`` (reused if
    already built by the same Python and extraction version) and describe them.

    Docstrings are separated by blank lines (a ``text:`` source reads paragraphs as records).
    """
    out = Path(out_dir)
    python = sys.version.split()[0]
    cached = _cached(out, "stdlib_docstrings", python)
    if cached is not None:
        return cached
    root = Path(root) if root is not None else stdlib_root()
    files = sorted(p for p in root.rglob("*.py")
                   if not any(part in EXCLUDED_DIRS for part in p.relative_to(root).parts))
    return _write_corpus(out, "stdlib_docstrings", python, files,
                         lambda path: module_docstrings(path.read_bytes(), min_chars),
                         heldout_every)


# troff special characters \(xx worth keeping as text; any other is dropped.
_TROFF_CHARS = {"em": "--", "en": "-", "hy": "-", "aq": "'", "dq": '"', "lq": '"', "rq": '"',
                "oq": "'", "cq": "'", "bu": "*", "co": "(c)", "rg": "(R)", "tm": "(TM)",
                "mu": "x", "<=": "<=", ">=": ">=", "ti": "~", "ha": "^", "rs": "\\",
                "ga": "`", "bv": "|", "ba": "|"}
# Macros whose arguments are running text (headings, fonts, list tags); all others are dropped.
_TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB", "IP",
                "Nm", "Nd", "Sh", "Ss", "Fl", "Ar", "Em", "Pa", "Dq", "Sq", "Xr", "It"}
# Macros that start a new paragraph.
_BREAK_MACROS = {"PP", "P", "LP", "SH", "SS", "TP", "IP", "HP", "Pp", "Sh", "Ss", "sp", "br"}
_ESCAPE = re.compile(
    r"\\(?:(?P<font>f(?:\[[^\]]*\]|\(..|.))"        # font change \fB \f(CW \f[I]
    r"|(?P<size>s[-+]?\d+)"                         # point size
    r"|(?P<string>[*n](?:\(..|\[[^\]]*\]|.))"        # string / number register
    r"|\((?P<char2>..)|\[(?P<charn>[^\]]*)\]"       # named character \(em \[em]
    r"|(?P<other>.))")


def _unescape(text: str) -> str:
    def repl(m: re.Match) -> str:
        name = m.group("char2") or m.group("charn")
        if name is not None:
            return _TROFF_CHARS.get(name, "")
        other = m.group("other")
        if other in ("-", "e", "\\"):
            return "-" if other == "-" else "\\"
        if other in (" ", "~", "0"):
            return " "
        return ""
    return _ESCAPE.sub(repl, text)


def troff_to_text(source: str) -> List[str]:
    """The paragraphs of a man page's troff source as plain text.

    Comments and requests are dropped except the text arguments of heading, font and list
    macros (``.SH NAME``, ``.B ls``, ``.IP``); font changes and other escapes are removed,
    ``\\-`` becomes '-', a few named characters become ASCII; a paragraph macro or a blank
    line starts a new paragraph. Not a troff renderer: good enough to read as prose.
    """
    paragraphs, current = [], []

    def flush():
        text = " ".join(" ".join(current).split())
        if text:
            paragraphs.append(text)
        current.clear()

    for line in source.splitlines():
        if line.startswith((".\\\"", "'\\\"", '.\\"')) or line.strip() in (".", ""):
            if not line.strip():
                flush()
            continue
        if line[:1] in (".", "'"):
            macro, _, rest = line[1:].strip().partition(" ")
            if macro in _BREAK_MACROS:
                flush()
            if macro not in _TEXT_MACROS or not rest:
                continue
            line = rest.replace('"', "")
            if macro == "IP":                       # .IP tag [indent]: drop the indent
                line = re.sub(r"\s+\d+(\.\d+)?[mnin]?$", "", line)
        current.append(_unescape(line))
    flush()
    return paragraphs


def manpage_paragraphs(path: Path, min_chars: int) -> List[str]:
    """One page's paragraphs of at least ``min_chars`` characters, joined into one record per
    page section run (blank-line separated text; ``.so`` redirections give nothing)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    source = raw.decode("utf-8", errors="replace")
    if source.lstrip().startswith(".so "):
        return []
    paragraphs = [p for p in troff_to_text(source) if len(p) >= min_chars]
    return ["\n".join(paragraphs)] if paragraphs else []


def build_manpage_corpus(out_dir, *, heldout_every: int = 20, min_chars: int = 40,
                         root: Path | None = None, sections=("1", "5", "7", "8")) -> CorpusInfo:
    """Write ``manpages.train.txt`` / ``.heldout.txt`` from the installed English manual pages
    (``root``/man<section>/, symlinks skipped) into ``out_dir`` and describe them; reused
    while the set of pages is the same. One record per page."""
    out = Path(out_dir)
    root = Path(root) if root is not None else Path("/usr/share/man")
    files = sorted(p for section in sections for p in (root / f"man{section}").glob("*")
                   if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no manual pages under {root}/man{{{','.join(sections)}}}: "
                                "install some (apt-get install manpages) or pass --data")
    origin = f"manpages:{len(files)}"
    cached = _cached(out, "manpages", origin)
    if cached is not None:
        return cached
    return _write_corpus(out, "manpages", origin, files,
                         lambda path: manpage_paragraphs(path, min_chars), heldout_every)


def header_paragraphs(path: Path, min_chars: int) -> List[str]:
    """A C header's blank-line separated blocks of at least ``min_chars`` characters."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    return [b.strip() for b in text.split("\n\n") if len(b.strip()) >= min_chars]


def build_c_header_corpus(out_dir, *, heldout_every: int = 20, min_chars: int = 40,
                          root: Path | None = None) -> CorpusInfo:
    """Write ``c_headers.train.txt`` / ``.heldout.txt`` from the C headers under ``root``
    (default /usr/include, recursively; symlinks skipped) into ``out_dir`` and describe them;
    reused while the set of headers is the same. One record per blank-line separated block."""
    out = Path(out_dir)
    root = Path(root) if root is not None else Path("/usr/include")
    files = sorted(p for p in root.rglob("*.h") if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no C headers under {root}: install some (apt-get install "
                                "libc6-dev) or pass --data")
    origin = f"c_headers:{len(files)}"
    cached = _cached(out, "c_headers", origin)
    if cached is not None:
        return cached
    return _write_corpus(out, "c_headers", origin, files,
                         lambda path: header_paragraphs(path, min_chars), heldout_every)


def corpus_sources(info: CorpusInfo) -> Tuple[str, str]:
    """(source, eval_source) ``DataConfig`` specs of a built corpus."""
    return f"text:{info.train_path}", f"text:{info.heldout_path}"
