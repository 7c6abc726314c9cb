"""How every command stops on SIGINT / SIGTERM (Ctrl-C, a scheduler's stop): one contract,
installed before the heavy imports (:func:`run_command`).

* Until its output is complete, a signal ends the command at once: what it registered as
  written so far (:func:`remove_on_stop`) is removed, one line is printed, exit 130. The signal
  is acted on from a thread of its own woken by the signal (:func:`signal.set_wakeup_fd`), so a
  command busy in a long library call (an import, a compilation) stops within moments, and no
  exception is ever raised inside library code (a ``KeyboardInterrupt`` raised inside an
  extension's initialisation or a C++ callback turned into an ``ImportError``, an abort, or
  an interrupt a garbage-collection callback swallowed).
* Once the output is complete and in place (:func:`output_complete`), signals are ignored and
  the command ends with exit 0: never a "done" line with exit 130.
* A command that handles signals itself (training saves a checkpoint and stops) says so with
  :func:`own_signals`; the thread then leaves them to its handlers.

Standard library only, so a command installs it from its first line. Library code never
calls it; a notebook that calls a command's ``main`` gets Python's own handling.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
QUIET_S, QUIET_DEADLINE_S = 1.0, 10.0
"""A threaded write's output is removed again until nothing has reappeared for QUIET_S
seconds (at most QUIET_DEADLINE_S)."""
_START, _OWN, _DONE = "start", "own", "done"
_lock = threading.RLock()
_state = {"phase": _START, "what": "stopped", "cleanups": []}


def stop_line(name: str, what: str) -> str:
    """The one line a command prints when signal ``name`` stopped it."""
    return f"error: {name} received: {what}"


def set_stop_message(what) -> None:
    """What the command's stop line says after "<SIGNAL> received: ", e.g. "nothing was
    written at DIR"; or a function of the signal's name giving the whole line."""
    _state["what"] = what


def remove_on_stop(path, threaded: bool = False) -> Callable[[], None]:
    """Register ``path`` as being written by the command: a signal before the output is
    complete removes it, or, where it is a directory that exists now, what appears in it
    from now on (what was there is kept). ``threaded``: a library writes into it from threads
    of its own (an Orbax save): while it is registered the signal is acted on by the main
    thread, between two of its steps, not at once from the stop thread (which removed the
    directory while a save's thread wrote it again). Returns the function that unregisters it
    (once it is complete, or removed by the command itself)."""
    path = Path(path).expanduser()
    kept = ({child.name for child in path.iterdir()}
            if path.is_dir() and not path.is_symlink() else None)

    def once() -> bool:
        """Remove what was written; whether anything was there."""
        if kept is None:
            there = path.exists() or path.is_symlink()
            _remove(path)
            return there
        new = [child for child in path.iterdir() if child.name not in kept] \
            if path.is_dir() else []
        for child in new:
            _remove(child)
        return bool(new)

    def clean() -> None:
        once()
        if threaded:   # a save's thread still in flight can write it again: until it is quiet
            quiet_since, deadline = time.monotonic(), time.monotonic() + QUIET_DEADLINE_S
            while time.monotonic() < deadline and time.monotonic() - quiet_since < QUIET_S:
                time.sleep(0.02)
                if once():
                    quiet_since = time.monotonic()
    clean.threaded = threaded
    with _lock:
        _state["cleanups"].append(clean)

    def forget() -> None:
        with _lock:
            if clean in _state["cleanups"]:
                _state["cleanups"].remove(clean)
    return forget


def _remove(path: Path) -> None:
    """Remove ``path``, a directory first moved aside so that a write still in flight in
    another thread cannot land in a half-removed directory under its name."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not path.is_symlink():
        aside = path.with_name(f".{path.name}.stopped-{os.getpid()}")
        try:
            path.rename(aside)
        except OSError:
            aside = path
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def output_complete() -> None:
    """The command's output is complete and in place: from now on a signal is ignored and the
    command ends with its own exit status."""
    with _lock:
        _state["phase"] = _DONE
        _state["cleanups"].clear()


def own_signals() -> None:
    """The command installs its own signal handlers from here (training): the stop thread
    leaves signals to them."""
    with _lock:
        _state["phase"] = _OWN


def stop_now(name: str) -> None:
    """Act on signal ``name`` that the command's own handler caught: while the contract's
    start phase lasts, as the contract does (one line, what was registered removed, exit 130;
    once, whichever of the two acts first); else return."""
    _stop(getattr(signal, name, signal.SIGINT))


def _stop(signum: int, from_thread: bool = False) -> None:
    """Act on signal ``signum`` by the contract (module docstring); ``from_thread``: the stop
    thread, which leaves it to the main thread while a threaded write is registered."""
    with _lock:
        # not installed: a command's main called from Python (a notebook, a test) keeps
        # Python's own handling, and its process is never ended here
        if _state["phase"] != _START or not _state.get("installed"):
            return
        if from_thread and any(getattr(c, "threaded", False) for c in _state["cleanups"]):
            return
        try:
            sys.stdout.flush()
        except (OSError, ValueError, RuntimeError):   # RuntimeError: a reentrant flush
            pass
        stderr = _silence_output()
        for clean in reversed(_state["cleanups"]):
            try:
                clean()
            except Exception:  # pylint: disable=broad-except  (on the way out: the rest too)
                pass
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        what = _state["what"]
        line = what(name) if callable(what) else stop_line(name, what)
        os.write(stderr, (("\n" if _progress_bar_open() else "") + line + "\n").encode())
        os._exit(130)


def _progress_bar_open() -> bool:
    """Whether a tqdm progress bar (lm-eval's, a dataset reader's) is open: it left the cursor
    at the end of its line, where the stop line would otherwise begin."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    try:
        return any(not getattr(bar, "disable", False)
                   for bar in list(getattr(tqdm, "_instances", ())))
    except Exception:  # pylint: disable=broad-except  (on the way out: never in the way)
        return False


def _silence_output() -> int:
    """Point standard output and error at the null device for the rest of the process (the
    writes that fail while the cleanups remove their directory report it from their threads,
    or from the main thread, with tracebacks); returns a descriptor of the standard error
    that was, for the stop line."""
    try:
        stderr = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
    except OSError:
        return 2
    return stderr


def _handler(signum, frame) -> None:
    del frame
    _stop(signum)


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        for signum in data:
            if signum in (int(s) for s in STOP_SIGNALS):
                _stop(signum, from_thread=True)


def install(what: Optional[str] = None) -> bool:
    """Install the contract's handlers (from the main thread; elsewhere, as in some notebook
    runners, nothing is installed and False is returned)."""
    if what is not None:
        set_stop_message(what)
    if _state.get("installed"):
        return True
    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _handler)
    except ValueError:
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:                  # the handlers alone: acted on between bytecodes
        os.close(read_fd)
        os.close(write_fd)
    else:
        threading.Thread(target=_watch, args=(read_fd,), name="dagmoe-stop",
                         daemon=True).start()
    _state["installed"] = True
    return True


def run_command(main: Callable[[], int], what: Optional[str] = None) -> int:
    """Every console command's entry: the contract installed (:func:`install`), then
    ``main()``; its exit status. After ``main`` returns, signals are ignored (the interpreter
    resets its handlers while it shuts down, and a signal then ended a finished command with a
    traceback or killed it); a command stopped (130) ends without that shutdown, which crashed
    with threads of an abandoned start-up still running (SIGSEGV, jax 0.10.2)."""
    install(what)
    with _lock:
        _state["phase"] = _START
        _state["cleanups"].clear()
    code = main()
    with _lock:
        _state["phase"] = _DONE
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def phase() -> str:
    """The contract's phase: 'start' (a signal stops the command), 'own' or 'done'."""
    return _state["phase"]


__all__: List[str] = ["install", "output_complete", "own_signals", "phase", "remove_on_stop",
                      "run_command", "set_stop_message", "stop_line", "stop_now"]
