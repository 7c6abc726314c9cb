"""The offline corpora of the quality benchmark: troff stripping and the manual-page corpus."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.experiments.corpus import build_manpage_corpus, corpus_sources, troff_to_text

PAGE = r""".\" a comment that must not appear
.TH LS "1" "September 2022" "GNU coreutils 9.1" "User Commands"
.SH NAME
ls \- list directory contents
.SH DESCRIPTION
.PP
List information about the FILEs (the current directory by default).
Sort entries alphabetically if none of \fB\-cftuvSUX\fR nor \fB\-\-sort\fR is specified.
.TP
\fB\-a\fR, \fB\-\-all\fR
do not ignore entries starting with .
.IP "\(bu" 4
a bullet \(em with a dash
.B bold words
"""


def test_troff_to_text_keeps_prose_and_drops_markup():
    paragraphs = troff_to_text(PAGE)
    text = "\n".join(paragraphs)
    assert paragraphs[0] == "NAME ls - list directory contents"
    assert "List information about the FILEs (the current directory by default). Sort entries " \
           "alphabetically if none of -cftuvSUX nor --sort is specified." in paragraphs
    assert "-a, --all do not ignore entries starting with ." in paragraphs
    assert "* a bullet -- with a dash bold words" in paragraphs
    for markup in ("comment", ".TH", "\\f", "\\-", "\\(", ".PP", "coreutils"):
        assert markup not in text, markup


def write_page(path, body: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(body.encode()))


def test_manpage_corpus_splits_by_page_and_skips_redirects(tmp_path):
    root = tmp_path / "man"
    for i in range(6):
        write_page(root / "man1" / f"tool{i}.1.gz",
                   f".SH NAME\ntool{i} \\- does thing number {i} for the benchmark corpus\n")
    write_page(root / "man1" / "alias.1.gz", ".so man1/tool0.1\n")     # a redirect: no text
    (root / "man1" / "link.1.gz").symlink_to(root / "man1" / "tool1.1.gz")
    write_page(root / "man5" / "fmt.5.gz", ".SH NAME\nfmt \\- the format of a file in section 5\n")
    write_page(root / "man3" / "lib.3.gz", ".SH NAME\nlib \\- a C function, not in the corpus\n")

    info = build_manpage_corpus(tmp_path / "out", root=root, heldout_every=3, min_chars=10)
    assert info.files == 8                      # 7 regular man1 files + 1 man5, no symlink, no man3
    train = (tmp_path / "out" / "manpages.train.txt").read_text()
    held = (tmp_path / "out" / "manpages.heldout.txt").read_text()
    records = [r for r in (train + "\n\n" + held).split("\n\n") if r.strip()]
    assert len(records) == 7                    # the redirect gave nothing
    assert info.heldout_files == 2 and held.count("NAME") == 2
    assert not set(train.split("\n\n")) & set(held.split("\n\n"))
    assert "C function" not in train + held and ".so" not in train + held
    assert corpus_sources(info) == (f"text:{info.train_path}", f"text:{info.heldout_path}")
    # built once: the second call reads the description back
    meta = json.loads((tmp_path / "out" / "manpages.json").read_text())
    assert meta["files"] == 8
    assert build_manpage_corpus(tmp_path / "out", root=root, heldout_every=3) == info


def test_manpage_corpus_without_pages_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manual pages under"):
        build_manpage_corpus(tmp_path / "out", root=tmp_path / "nothing")
