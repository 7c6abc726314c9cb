"""benchmarks/RESULTS.md's tables are true for the pins: each section that holds a table says, in
a paragraph of its own beginning ``Versions:``, which jax it was measured with; a section measured
under another jax than requirements.txt pins says so ("older pin") on that line and gives what
today's pin gives beside it (the paragraph names ``jax <today's pin>``: its figure, or why the table
was not measured again). Read from the text only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "RESULTS.md"
JAX = re.compile(r"\bjax (\d+\.\d+\.\d+)\b")
MARK = "older pin"


def jax_pin(requirements: str) -> str:
    """The jax version requirements.txt pins (``jax==X.Y.Z``)."""
    match = re.search(r"^jax==(\S+)\s*$", requirements, re.M)
    assert match, "requirements.txt pins no jax"
    return match.group(1)


def sections(text: str) -> List[Tuple[str, List[str]]]:
    """(heading, lines) of every ``##`` / ``###`` section, headings inside fenced blocks not
    counted."""
    out: List[Tuple[str, List[str]]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{2,3} ", line):
            out.append((line, []))
        elif out:
            out[-1][1].append(line)
    return out


COMMAND = ("python", "DAGMOE_", "XLA_FLAGS", "JAX_", "pip ", "bash ", "cd ", "export ", "#")


def has_table(lines: List[str]) -> bool:
    """A markdown table row, or a fenced block of printed output: one with a line that is not a
    command, its continuation or a comment."""
    fenced, continued = False, False
    for line in lines:
        if line.startswith("```"):
            fenced, continued = not fenced, False
            continue
        if not fenced and line.startswith("|"):
            return True
        if fenced and line.strip():
            if not continued and not line.lstrip().startswith(COMMAND):
                return True
            continued = line.rstrip().endswith("\\")
    return False


def problems(text: str, pin: str) -> List[str]:
    """What breaks the rule of the module docstring, one line per section."""
    found = []
    for heading, lines in sections(text):
        if not has_table(lines):
            continue
        starts = [i for i, line in enumerate(lines) if line.startswith("Versions:")]
        if len(starts) != 1:
            found.append(f"{heading}: {len(starts)} 'Versions:' lines, not 1")
            continue
        paragraph = []                     # the line and its continuation, to a blank line
        for line in lines[starts[0]:]:
            if not line.strip():
                break
            paragraph.append(line)
        versions = " ".join(paragraph)
        named = JAX.findall(versions)
        if not named:
            found.append(f"{heading}: its Versions line names no 'jax X.Y.Z'")
        elif any(v != pin for v in named) and not (MARK in versions and f"jax {pin}" in versions):
            found.append(f"{heading}: measured under jax {', '.join(sorted(set(named)))}, not the "
                         f"pinned {pin}, without '{MARK}' and today's 'jax {pin}' figure")
    return found


def test_every_results_table_names_its_versions_and_marks_an_older_pin():
    pin = jax_pin((REPO / "requirements.txt").read_text())
    assert problems(RESULTS.read_text(), pin) == []


def test_the_rule_catches_an_unmarked_older_pin_and_a_missing_line():
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    ok = f"## Fresh\n\n{table}\nVersions: jax 0.11.2, Python 3.12\n"
    old = f"## Old\n\n{table}\nVersions: jax 0.10.2, Python 3.11\n"
    marked = (f"## Old\n\n{table}\nVersions: jax 0.10.2 (an older pin;\njax 0.11.2 gives 1.45 "
              "s/step)\n")
    missing = f"## Bare\n\n```\n| run | s |\n```\n"
    prose = "## Words\n\nNo table here.\n\n```bash\npython -m benchmarks.x | tee out\n```\n"
    assert problems(ok, "0.11.2") == []
    assert problems(marked, "0.11.2") == []
    assert problems(prose, "0.11.2") == []
    assert len(problems(old, "0.11.2")) == 1 and "0.10.2" in problems(old, "0.11.2")[0]
    assert problems(missing, "0.11.2") == ["## Bare: 0 'Versions:' lines, not 1"]
    # a section measured under today's pin becomes an older pin's when the pin moves
    assert len(problems(ok, "0.12.0")) == 1


def test_the_pin_is_read_from_requirements():
    assert jax_pin("numpy==2\njax==0.11.2\njaxlib==0.11.2\n") == "0.11.2"
