"""Synthetic dynamic-programming tasks written as one line of text each.

Every example is a single line ``PREFIX INPUTS = ANSWER\\n``; the *prompt* is everything up to
and including ``=`` and the *answer* is the rest of the line, including its leading space and
the ``\\n``. The formats use small alphabets, so they are cheap under a byte tokenizer:

* ``lis``: ``lis 3 1 4 1 5 9 2 6 = 4\\n``. Inputs: ``size`` digits in 0-9, space separated.
  Answer: the length of the longest *strictly* increasing subsequence (at most 10).
* ``edit_distance``: ``edit abca acb = 2\\n``. Inputs: a string of ``size`` letters and one
  of ``size - 2 .. size + 2`` letters (at least 1), both over ``abcd``. Answer: the
  Levenshtein distance (unit-cost insert, delete, substitute).
* ``lcs``: ``lcs abca acb = 2\\n``. Inputs as for ``edit_distance``. Answer: the length of
  the longest common subsequence.

:func:`generate` draws an example from a NumPy generator and a problem ``size``, which is
explicit so that a benchmark can ask for sizes longer than those seen in training. Each task
also has a brute-force solver (exponential; for tests on small sizes) and :func:`parse` reads a
line back.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Callable, Optional

import numpy as np

DIGITS = "0123456789"
LETTERS = "abcd"


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance: ``prompt`` (ends with '=') and ``answer`` (' N\\n')."""

    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The full line, prompt then answer."""
        return self.prompt + self.answer


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: how to draw inputs of a size, solve them (DP and brute force), and write them.

    name: the registry key (used in ``DataConfig.source='synthetic:...'``).
    prefix: the first word of each line.
    draw: ``(rng, size) -> inputs`` (a tuple).
    solve: ``inputs -> int`` by dynamic programming.
    brute_force: ``inputs -> int`` by exhaustive search (tests only; exponential).
    write: ``inputs -> str`` the text between the prefix and '='.
    read: ``str -> inputs`` the inverse of ``write``.
    """

    name: str
    prefix: str
    draw: Callable[[np.random.Generator, int], tuple]
    solve: Callable[[tuple], int]
    brute_force: Callable[[tuple], int]
    write: Callable[[tuple], str]
    read: Callable[[str], tuple]


# ---- longest strictly increasing subsequence ----------------------------------------------

def _lis_draw(rng: np.random.Generator, size: int) -> tuple:
    return (tuple(int(v) for v in rng.integers(0, 10, size)),)


def _lis_solve(inputs: tuple) -> int:
    (seq,) = inputs
    tails: list[int] = []  # tails[k]: smallest tail of an increasing subsequence of length k+1
    for v in seq:
        k = bisect.bisect_left(tails, v)  # strict: equal values do not extend
        if k == len(tails):
            tails.append(v)
        else:
            tails[k] = v
    return len(tails)


def _lis_brute(inputs: tuple) -> int:
    (seq,) = inputs
    for r in range(len(seq), 0, -1):
        for idx in itertools.combinations(range(len(seq)), r):
            if all(seq[a] < seq[b] for a, b in zip(idx, idx[1:])):
                return r
    return 0


def _lis_write(inputs: tuple) -> str:
    return " ".join(map(str, inputs[0]))


def _lis_read(text: str) -> tuple:
    return (tuple(int(v) for v in text.split()),)


# ---- two strings: edit distance and LCS ---------------------------------------------------

def _pair_draw(rng: np.random.Generator, size: int) -> tuple:
    n_b = max(1, size + int(rng.integers(-2, 3)))
    a = "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), size))
    b = "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), n_b))
    return (a, b)


def _edit_solve(inputs: tuple) -> int:
    a, b = inputs
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
        prev = cur
    return prev[-1]


def _edit_brute(inputs: tuple) -> int:
    a, b = inputs
    if not a or not b:
        return len(a) + len(b)
    return min(_edit_brute((a[1:], b)) + 1, _edit_brute((a, b[1:])) + 1,
               _edit_brute((a[1:], b[1:])) + (a[0] != b[0]))


def _lcs_solve(inputs: tuple) -> int:
    a, b = inputs
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0] * (len(b) + 1)
        for j, cb in enumerate(b, 1):
            cur[j] = prev[j - 1] + 1 if ca == cb else max(prev[j], cur[j - 1])
        prev = cur
    return prev[-1]


def _is_subsequence(s: str, t: str) -> bool:
    it = iter(t)
    return all(c in it for c in s)


def _lcs_brute(inputs: tuple) -> int:
    a, b = inputs
    for r in range(len(a), 0, -1):
        for idx in itertools.combinations(range(len(a)), r):
            if _is_subsequence("".join(a[i] for i in idx), b):
                return r
    return 0


def _pair_write(inputs: tuple) -> str:
    return f"{inputs[0]} {inputs[1]}"


def _pair_read(text: str) -> tuple:
    a, b = text.split()
    return (a, b)


TASKS: dict[str, Task] = {
    "lis": Task("lis", "lis", _lis_draw, _lis_solve, _lis_brute, _lis_write, _lis_read),
    "edit_distance": Task("edit_distance", "edit", _pair_draw, _edit_solve, _edit_brute,
                          _pair_write, _pair_read),
    "lcs": Task("lcs", "lcs", _pair_draw, _lcs_solve, _lcs_brute, _pair_write, _pair_read),
}
_BY_PREFIX = {t.prefix: t for t in TASKS.values()}


def get_task(name: str) -> Task:
    """The registered task ``name``; an unknown name is a one-line ``ValueError``."""
    if name not in TASKS:
        raise ValueError(f"task {name!r} is invalid: expected one of {', '.join(map(repr, TASKS))}")
    return TASKS[name]


def format_example(task: str, inputs: tuple) -> Example:
    """The example for ``inputs`` of ``task``, its answer computed by dynamic programming."""
    t = get_task(task)
    return Example(prompt=f"{t.prefix} {t.write(inputs)} =", answer=f" {t.solve(inputs)}\n")


def generate(task: str, rng: np.random.Generator, size: int) -> Example:
    """Draw one example of ``task`` with problem size ``size`` (>= 1) from ``rng``.

    Deterministic given the generator's state; see the module docstring for what ``size``
    means for each task.
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size={size!r} is invalid: expected an integer >= 1")
    t = get_task(task)
    return format_example(task, t.draw(rng, int(size)))


def parse(line: str) -> tuple[str, tuple, Optional[int]]:
    """Read a task line back: ``(task name, inputs, answer)``.

    ``answer`` is None when the line has no '=' or what follows it is not an integer. A line of
    no known task is a one-line ``ValueError``.
    """
    prompt, eq, rest = line.partition("=")
    words = prompt.split(maxsplit=1)
    if not words or words[0] not in _BY_PREFIX:
        raise ValueError(f"line {line[:40]!r} is not a task example: expected it to start with "
                         f"one of {', '.join(map(repr, _BY_PREFIX))}")
    t = _BY_PREFIX[words[0]]
    inputs = t.read(words[1] if len(words) > 1 else "")
    return t.name, inputs, (parse_answer(rest) if eq else None)


def parse_answer(text: str) -> Optional[int]:
    """The integer an answer text (' 4\\n', or a model's continuation) starts with, or None.

    Reads up to the first newline; surrounding spaces are ignored.
    """
    first = text.split("\n", 1)[0].strip()
    try:
        return int(first)
    except ValueError:
        return None
