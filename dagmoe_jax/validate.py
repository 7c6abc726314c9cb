"""Field checks for the configuration dataclasses: one message shape for every invalid value.

``check(ok, "RouterConfig", "top_k", 0, "an integer >= 1")`` raises
``ValueError("RouterConfig.top_k=0 is invalid: expected an integer >= 1")``: the field, the value
and what it accepts, in one line (the command-line tools print only the first line of an error).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional


def check(ok: bool, cls: str, field: str, value, valid: str) -> None:
    """Raise the one-line ``ValueError`` for ``cls.field=value`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{cls}.{field}={value!r} is invalid: expected {valid}")


def choice(cls: str, field: str, value, options: Iterable) -> None:
    """``value`` must be one of ``options``."""
    options = tuple(options)
    check(value in options, cls, field, value, "one of " + ", ".join(map(repr, options)))


def positive(cls: str, field: str, value) -> None:
    """``value`` must be an integer >= 1 (booleans are not integers here)."""
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, cls, field,
          value, "an integer >= 1")


def nonnegative(cls: str, field: str, value) -> None:
    """``value`` must be a number >= 0."""
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
          cls, field, value, "a number >= 0")


def is_number(value) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def nonnegative_int(cls: str, field: str, value) -> None:
    """``value`` must be an integer >= 0 (booleans are not integers here)."""
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, cls, field,
          value, "an integer >= 0")


def in_range(cls: str, field: str, value, low: float, high: float, *, low_open: bool = False,
             high_open: bool = False) -> None:
    """``value`` must be a number in [low, high] (``low_open`` / ``high_open``: excluded)."""
    ok = (is_number(value) and (value > low if low_open else value >= low)
          and (value < high if high_open else value <= high))
    if high == float("inf"):
        valid = f"a number {'>' if low_open else '>='} {low}"
    else:
        valid = (f"a number in {'(' if low_open else '['}{low}, {high}"
                 f"{')' if high_open else ']'}")
    check(ok, cls, field, value, valid)


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type name when the message is empty): what a
    command prints as its one-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def error_chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, then what it was raised from (or during), innermost last."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)


def interrupt_within(err: BaseException) -> Optional[KeyboardInterrupt]:
    """The ``KeyboardInterrupt`` (Ctrl-C, a run's SIGINT / SIGTERM) ``err`` was raised from or
    while handling, if any: a library that an interrupt hit can surface it as its own error
    (Orbax wraps an interrupted read; Python's ``threading`` said 'release unlocked lock' when
    one landed in a thread pool's semaphore), and the interrupt is what stopped the work."""
    return next((e for e in error_chain(err) if isinstance(e, KeyboardInterrupt)), None)
