"""What every command line shares: flag parsing, one-line errors (exit 2), the quiet start of a
command (:func:`quiet_background_errors`) and the ``main`` of a command that writes a directory.

The commands (:mod:`dagmoe_jax.cli`, the tools' ``__main__`` and :mod:`dagmoe_jax.harness.cli`)
and the benchmarks import it; the library below them never does. Standard library and
:mod:`dagmoe_jax.validate` only (JAX only inside :func:`cpu_without_accelerators`), so a
command's ``--help`` and argument errors do not wait for JAX.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional, Tuple

from dagmoe_jax import stopping
from dagmoe_jax.validate import first_line

# What a command-line tool reports as a one-line error (exit 2) instead of a traceback.
USER_ERRORS = (ValueError, FileNotFoundError)


def report_error(err: BaseException, code: int = 2) -> int:
    """Print ``error: <first line>`` to stderr and return the exit code (2: bad input)."""
    print(f"error: {first_line(err)}", file=sys.stderr)
    return code


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise ``ValueError(message)`` instead of printing
    argparse's usage block and exiting: the command line reports it as one line
    (:func:`report_error`, exit 2). ``--help`` behaves as argparse's own."""

    def error(self, message):
        raise ValueError(message)


class _BackgroundNoise(logging.Filter):
    """Drops what asyncio and Orbax's threads log about a read or write that failed: the caller
    that waits on it reports the failure once (one line), and these repeat it with tracebacks,
    once per array (hundreds of lines after one corrupt checkpoint or a full disk)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return "exception was never retrieved" not in str(record.msg)
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _drop_closed_loop_errors(hook):
    def unraisablehook(unraisable):
        # TensorStore callbacks of an abandoned Orbax read or write, arriving after its event
        # loop closed, report "RuntimeError: Event loop is closed" as unraisable.
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        hook(unraisable)
    unraisablehook.quiets_closed_loops = True
    return unraisablehook


def cpu_without_accelerators() -> bool:
    """Pin JAX to the CPU where this host has no accelerator and ``JAX_PLATFORMS`` leaves the
    choice to JAX; returns whether it did. JAX would otherwise start every plugin installed
    beside it (``requirements-tpu.txt`` brings libtpu and the CUDA plugin, which the suite and
    the compile tool use without the hardware) and each prints its failure to find its
    device: libtpu five lines, the CUDA plugin a traceback. The probes are JAX's own (a
    Google TPU on the PCI bus, an NVIDIA or AMD GPU's device files), so a host with a TPU or
    a GPU is left to JAX. Call before the first computation (the backends start then)."""
    import os                       # pylint: disable=import-outside-toplevel
    if os.environ.get("JAX_PLATFORMS"):
        return False
    try:
        import jax                  # pylint: disable=import-outside-toplevel
        from jax._src import hardware_utils, xla_bridge  # pylint: disable=import-outside-toplevel
        tpu_chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
        if (jax.config.jax_platforms or tpu_chips or hardware_utils.has_visible_nvidia_gpu()
                or hardware_utils.num_available_amd_gpus(stop_at=1)
                or xla_bridge.backends_are_initialized()):
            return False
    except (ImportError, AttributeError, TypeError, OSError):
        return False                # another JAX than the pinned one: leave it be
    jax.config.update("jax_platforms", "cpu")
    return True


def quiet_background_errors() -> None:
    """Silence the echoes of a failed checkpoint read or write (asyncio's "exception was never
    retrieved", Orbax's thread errors, "Event loop is closed", "coroutine ... was never
    awaited"), and start JAX on the CPU alone where the host has no accelerator
    (:func:`cpu_without_accelerators`). For command lines only, whose callers report the
    failure itself in one line; the library leaves logging and JAX alone. Idempotent."""
    cpu_without_accelerators()
    noise = _BackgroundNoise()
    for name in ("asyncio", "absl"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _BackgroundNoise) for f in logger.filters):
            logger.addFilter(noise)
    if not getattr(sys.unraisablehook, "quiets_closed_loops", False):
        sys.unraisablehook = _drop_closed_loop_errors(sys.unraisablehook)
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited",
                            category=RuntimeWarning)


def gin_flag_bindings(args: Iterable[str]) -> Tuple[List[str], List[str]]:
    """T5X-style ``--gin.NAME.PARAM=VALUE`` flags as gin bindings ``NAME.PARAM = VALUE``.

    Returns (bindings, the arguments that are not such flags) so the caller can reject those.
    """
    bindings, unknown = [], []
    for item in args:
        if item.startswith("--gin.") and "=" in item:
            name, value = item[len("--gin."):].split("=", 1)
            bindings.append(f"{name} = {value}")
        else:
            unknown.append(item)
    return bindings, unknown


def gin_parser() -> OneLineParser:
    """A command's parser with ``-h/--help`` and train.py's configuration flags, ``--gin_file``
    and ``--gin_bindings`` (``--gin.NAME.PARAM=VAL`` flags are read by
    :func:`parse_gin_command`)."""
    parser = OneLineParser(add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--gin_file", action="append", default=[])
    parser.add_argument("--gin_bindings", action="append", default=[])
    return parser


def parse_gin_command(parser: argparse.ArgumentParser, argv, command: str):
    """(args, gin bindings: ``--gin_bindings`` then the ``--gin.NAME.PARAM=VAL`` flags) of
    ``argv``; any other unknown argument is a one-line ``ValueError`` naming ``command``'s
    help."""
    args, rest = parser.parse_known_args(argv)
    flags, unknown = gin_flag_bindings(rest)
    if unknown:
        raise ValueError(f"unknown argument {unknown[0]!r} (see {command} --help)")
    return args, list(args.gin_bindings) + flags


def parse_or_report(parse_args: Callable, argv, doc: str) -> Tuple[Any, Optional[int]]:
    """``(parse_args(argv), None)`` for a command's ``main`` (``argv`` None: the process's
    arguments), or ``(None, exit code)`` when it is done already: invalid arguments reported
    in one line (2), or ``--help`` answered with the command's ``doc`` (0)."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        return None, report_error(err)
    if args.help:
        print(doc)
        return None, 0
    return args, None


def check_new_directory(flag: str, path: str) -> None:
    """One-line ValueError unless ``path`` (the value of ``--flag``) is absent or an empty
    directory: a command that writes a directory never writes over anything."""
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--{flag}={path} already exists and is not an empty directory: "
                         f"choose a new path")


def write_command(parse_args: Callable, argv, doc: str, work: Callable[[Any, Callable], Any],
                  target: Callable[[Any], str], threaded: bool = False) -> int:
    """The ``main`` of a command that writes one directory (export, import): arguments as
    :func:`parse_or_report` reads them, then ``work(args, log)``, whose library call hands
    ``log`` its last line once the directory is complete and in place; a user error is one
    line (2), success is 0. Under the stop contract (:mod:`dagmoe_jax.stopping`) a signal
    before that line removes the directory (or empties the empty one that was there) and says
    nothing was written at ``target(args)`` (130); after it, the command finishes (0). Without
    the contract (``main`` called from Python) Ctrl-C is the same line, and ``work``'s library
    call removes what it wrote. ``threaded``: ``work`` writes the directory from threads of
    its own too (:func:`dagmoe_jax.stopping.remove_on_stop`)."""
    args, code = parse_or_report(parse_args, argv, doc)
    if code is not None:
        return code
    out = Path(target(args)).expanduser()
    stopping.set_stop_message(f"nothing was written at {out}")
    forget = stopping.remove_on_stop(out, threaded=threaded)
    quiet_background_errors()

    def log(message: str) -> None:
        forget()
        stopping.output_complete()
        print(message, flush=True)
    try:
        work(args, log)
    except KeyboardInterrupt:
        print(stopping.stop_line("SIGINT", f"nothing was written at {out}"), file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        return report_error(err)
    return 0
