"""Compile a kernel's C++ source into a shared library once per machine, and cache it.

The library is built with ``-march=native`` for the CPU it runs on, so the cache key covers
the source, the flags, the compiler, the jaxlib version (its FFI headers) and the CPU's
feature flags. Builds write to a temporary file and rename it into place, so concurrent
processes (pytest workers, hosts sharing a home directory) never load a half-written library.

Environment:
  DAGMOE_KERNEL_CACHE: cache directory (default ``~/.cache/dagmoe_jax/kernels``).
  CXX: the C++ compiler (default: the first of g++, c++, clang++ on PATH).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
         "-fno-math-errno", "-ffp-contract=fast")


class KernelBuildError(RuntimeError):
    """No compiler, or the compiler rejected the source (the message has its first lines)."""


def compiler() -> Optional[str]:
    """The C++ compiler to use, or None when there is none."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("DAGMOE_KERNEL_CACHE")
                or Path.home() / ".cache" / "dagmoe_jax" / "kernels")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def target_path(source: Path, cxx: str) -> Path:
    """Where ``source`` compiled by ``cxx`` is cached: the name carries a hash of the source,
    flags, compiler, jaxlib version and CPU."""
    import jaxlib

    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), cxx.encode(),
                 jaxlib.__version__.encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def is_built(source: Path) -> bool:
    """Whether ``source`` is already compiled in the cache (no compiler: False)."""
    cxx = compiler()
    return cxx is not None and target_path(source, cxx).exists()


def build(source: Path) -> Path:
    """Return the path of ``source`` compiled into a shared library, compiling it if needed."""
    import jax

    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (install g++ or set CXX)")
    include = jax.ffi.include_dir()
    target = target_path(source, cxx)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, "-isystem", include, str(source), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            first = " | ".join(proc.stderr.strip().splitlines()[:3])
            raise KernelBuildError(f"{cxx} failed on {source.name}: {first}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
