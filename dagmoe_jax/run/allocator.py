"""Process set-up for the command-line entry points: the memory allocator.

XLA:CPU allocates its temporary buffers afresh for every execution. glibc's malloc, as it comes,
serves large ones with ``mmap`` (or from per-thread arenas whose heaps it unmaps when they empty)
and returns them to the kernel on free, so each training step page-faults all of its activation
memory back in, and writing a fresh buffer runs several times slower than writing reused
memory (benchmarks/RESULTS.md: ``benchmarks/alloc_bandwidth.py``).

:func:`configure_allocator`, which ``train.py`` and the benchmarks call first, does one of two
things, and :func:`allocator` says which:

* **TCMalloc** when it is installed (Debian / Ubuntu: ``apt-get install libtcmalloc-minimal4``)
  and not yet loaded: an allocator can only be swapped before the process starts, so the process
  replaces itself (same PID, same arguments) with ``LD_PRELOAD`` naming it.
  ``DAGMOE_TCMALLOC=0`` turns this off (unset or 1: on when found);
  ``DAGMOE_TCMALLOC=/path/to/lib.so`` names the library.
* **glibc tuned** otherwise (a new user's machine): ``mallopt`` makes glibc keep what it frees:
  one arena for every thread (``M_ARENA_MAX``), no ``mmap`` for large blocks (``M_MMAP_MAX``)
  and no trimming of the heap's top (``M_TRIM_THRESHOLD``). The step's buffers are then reused
  from the heap: no page faults after the first steps, and the MoE-s step takes 0.84x the
  time (benchmarks/RESULTS.md). The heap keeps its peak size; :func:`release_memory` hands
  free pages back between benchmark variants. ``DAGMOE_GLIBC_TUNE=0`` leaves glibc as it is.
  The arena limit binds threads that have not allocated yet, so call it before JAX starts its
  thread pools (in a notebook: ``from dagmoe_jax.run.allocator import configure_allocator;
  configure_allocator()`` in the first cell, before anything touches a JAX device).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Mapping, Optional, Sequence

SWITCH = "DAGMOE_TCMALLOC"
GLIBC_SWITCH = "DAGMOE_GLIBC_TUNE"
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
# mallopt takes an int; glibc stores the trim threshold as a size_t, so -1 is SIZE_MAX: never
# trim. The largest int, 2^31 - 1, trimmed any free top of the heap over 2 GB, which a step
# whose temporaries exceed that (DAG-MoE-s at L 3) handed back and faulted in again every step.
NEVER_TRIM = -1
GLIBC_TUNED = "glibc malloc, tuned (one arena, no mmap, no trim)"
_glibc_tuned = False
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
    """What serves this process's memory: 'tcmalloc (LD_PRELOAD)', :data:`GLIBC_TUNED` after
    :func:`tune_glibc_malloc`, else 'system malloc'."""
    if tcmalloc_preloaded():
        return "tcmalloc (LD_PRELOAD)"
    return GLIBC_TUNED if _glibc_tuned else "system malloc"


def _glibc():
    """glibc's C library, or None where malloc is not glibc's (musl, macOS, TCMalloc)."""
    if not sys.platform.startswith("linux") or tcmalloc_preloaded():
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # only glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def tune_glibc_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Make glibc's malloc keep freed memory for reuse (module docstring); True when done.

    Nothing is done (False) off glibc, under TCMalloc, or when ``DAGMOE_GLIBC_TUNE`` is '0'."""
    global _glibc_tuned
    libc = _glibc()
    if libc is None or environ.get(GLIBC_SWITCH, "") == "0":
        return False
    done = (libc.mallopt(M_ARENA_MAX, 1) == 1 and libc.mallopt(M_MMAP_MAX, 0) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1)
    _glibc_tuned = _glibc_tuned or done
    return done


def release_memory() -> None:
    """Free what one benchmark variant left behind before the next one is built.

    Drops JAX's compilation caches and unreferenced arrays, then asks TCMalloc (when
    preloaded) or the tuned glibc to hand its free pages back to the kernel: both keep them for
    reuse, and variants of other sizes do not fit them, so a process timing many models would
    otherwise grow until the kernel kills it.
    """
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    if tcmalloc_preloaded():
        release = getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)
        if release is not None:
            release()
    elif _glibc_tuned:
        _glibc().malloc_trim(0)


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


def configure_allocator() -> str:
    """TCMalloc when installed (this re-executes the process), else glibc tuned (module
    docstring). Call it first thing in an entry point; returns :func:`allocator`."""
    reexec_with_tcmalloc()
    tune_glibc_malloc()
    return allocator()
