"""Process set-up for the command-line entry points: TCMalloc as the memory allocator.

XLA:CPU allocates its temporary buffers afresh for every execution. glibc's malloc serves
large ones with ``mmap`` and returns them to the kernel on free, so each training step
page-faults all of its activation memory back in: writing a fresh 128 MB buffer ran at about
5 GB/s on the 2-core machine against about 29 GB/s under TCMalloc, which keeps freed memory for
reuse. The s model's training step is about 15% faster under TCMalloc (README, step throughput).

An allocator can only be swapped before the process starts, so ``train.py`` and the throughput
benchmarks call :func:`reexec_with_tcmalloc` first: when TCMalloc is installed (Debian / Ubuntu:
``apt-get install libtcmalloc-minimal4``) and not yet loaded, the process replaces itself
(same PID, same arguments) with ``LD_PRELOAD`` naming it. ``DAGMOE_TCMALLOC=0`` turns this
off (unset or 1: on when found); ``DAGMOE_TCMALLOC=/path/to/lib.so`` names the library. In a
notebook, start Jupyter with ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4``.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Optional, Sequence

SWITCH = "DAGMOE_TCMALLOC"
LIBRARY_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
               "/usr/lib", "/usr/local/lib")


def find_tcmalloc(dirs: Sequence[str] = SEARCH_DIRS) -> Optional[str]:
    """Path of the first TCMalloc shared library in ``dirs``, or None."""
    for directory in dirs:
        for name in LIBRARY_NAMES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    return None


def tcmalloc_environment(environ: Mapping[str, str], platform: str = sys.platform,
                         dirs: Sequence[str] = SEARCH_DIRS) -> Optional[dict]:
    """The environment to re-execute with, or None when nothing should change.

    None when not on Linux, when ``DAGMOE_TCMALLOC`` is '0', when no library is found, or when
    ``LD_PRELOAD`` already names the library (which also ends the re-execution).
    """
    switch = environ.get(SWITCH, "")
    if not platform.startswith("linux") or switch == "0":
        return None
    library = switch if switch not in ("", "1") else find_tcmalloc(dirs)
    if not library or not os.path.isfile(library):
        return None
    preload = environ.get("LD_PRELOAD", "")
    if library in preload.replace(":", " ").split():
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library} {preload}".strip()
    return env


def tcmalloc_preloaded() -> bool:
    """Whether this process runs with TCMalloc preloaded."""
    return "tcmalloc" in os.environ.get("LD_PRELOAD", "")


def allocator() -> str:
    """'tcmalloc (LD_PRELOAD)' when this process preloads TCMalloc, else 'system malloc'."""
    return "tcmalloc (LD_PRELOAD)" if tcmalloc_preloaded() else "system malloc"


def release_memory() -> None:
    """Free what one benchmark variant left behind before the next one is built.

    Drops JAX's compilation caches and unreferenced arrays, then asks TCMalloc (when preloaded)
    to hand its free pages back to the kernel: it keeps them for reuse, and variants of other
    sizes do not fit them, so a process timing many models would otherwise grow until the
    kernel kills it.
    """
    import ctypes
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    if tcmalloc_preloaded():
        release = getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)
        if release is not None:
            release()


def reexec_with_tcmalloc() -> None:
    """Replace this process by itself with TCMalloc preloaded (see the module docstring).

    Returns without doing anything when :func:`tcmalloc_environment` says so or the exec fails.
    Call it before any work (it restarts the interpreter with the original command line).
    """
    env = tcmalloc_environment(os.environ)
    if env is None:
        return
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:
        return
