"""SIGINT / SIGTERM during a run: recorded in a flag, and either interrupting at once (while a
run starts, nothing is worth saving) or only recorded (while it trains, the loop saves and
stops). One mechanism for the command line and :func:`~dagmoe_jax.train.loop.train`.

Standard library (and :mod:`dagmoe_jax.validate`) only, so a command can install it before the
heavy imports.
"""

from __future__ import annotations

import contextlib
import signal
import sys

from dagmoe_jax.validate import interrupt_within


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT / SIGTERM before its training began: nothing of it is kept."""


def stopped_before_training(name: str) -> str:
    """The one line a command prints for a signal ``name`` before training began."""
    return (f"error: {name} received before training began: stopped, and the run directory "
            "is as it was (a new one is not created)")


@contextlib.contextmanager
def on_signals(flag: dict, *, interrupt: bool = False):
    """Within: SIGTERM / SIGINT record the first one's name in ``flag['signal']``; with
    ``interrupt`` they also raise :class:`Interrupted` (a KeyboardInterrupt) at once, else
    further signals change nothing until the block is left (a save in flight finishes). An
    interrupt some library callback swallowed (a garbage-collection callback can) stays in
    ``flag`` for :func:`check_interrupted`, and Python's 'ignored' traceback for it is not
    printed. With ``interrupt``, an exception that leaves the block raised from or while
    handling the interrupt (:func:`~dagmoe_jax.validate.interrupt_within`: Python's
    ``threading`` Condition said 'release unlocked lock' when SIGINT landed in a thread pool's
    semaphore), or any exception after this block raised the interrupt (one lost on its way,
    as numpy's import loses it), comes out as :class:`Interrupted`, chained to it: the signal, not the damage it
    did on its way, is what stopped the run. Outside the main thread (some notebook runners)
    no handler is installed. ``flag['act']``, where a command put one, is called with the
    signal's name before the interrupt is raised: the command's stop, which ends the process
    without an exception raised inside library code."""
    def handler(signum, frame):
        del frame
        name = signal.Signals(signum).name
        flag.setdefault("signal", name)
        if interrupt:
            flag.setdefault("interrupted", name)
            if flag.get("act") is not None:
                flag["act"](name)     # a command's own stop, which ends the process
            raise Interrupted(name)
    if interrupt:
        _quiet_swallowed_interrupts()
    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:
        pass
    try:
        yield
    except Exception as err:
        if interrupt:
            if flag.get("interrupted"):
                # the interrupt was raised here and lost on its way out: numpy's import turned
                # it into "numpy._core.multiarray failed to import", whose chain has no trace
                raise Interrupted(flag["interrupted"]) from err
            raise_as_interrupt(err)
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def raise_as_interrupt(err: BaseException) -> None:
    """Raise :class:`Interrupted`, chained to ``err``, when ``err`` was raised from or while
    handling an interrupt (:func:`~dagmoe_jax.validate.interrupt_within`)."""
    inner = interrupt_within(err)
    if inner is not None:
        raise Interrupted(str(inner) or "SIGINT") from err


def check_interrupted(flag: dict) -> None:
    """Raise :class:`Interrupted` when a signal was recorded in ``flag``."""
    if flag.get("signal"):
        raise Interrupted(flag["signal"])


def _quiet_swallowed_interrupts() -> None:
    """Python reports a KeyboardInterrupt raised inside a garbage-collection callback or a
    finalizer as 'ignored', with a traceback on stderr; :func:`on_signals` records the signal
    too, so it is acted on at the next phase: print nothing for it (other unraisable
    exceptions are reported as before)."""
    previous = sys.unraisablehook
    if getattr(previous, "quiet_interrupts", False):
        return

    def hook(unraisable):
        if not (isinstance(unraisable.exc_type, type)
                and issubclass(unraisable.exc_type, KeyboardInterrupt)):
            previous(unraisable)
    hook.quiet_interrupts = True
    sys.unraisablehook = hook
