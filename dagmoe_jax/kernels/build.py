"""Compile a kernel's C++ source into a shared library once per machine, and cache it.

The library is built with ``-march=native`` for the CPU it runs on, so the cache key covers
the source, the flags, the compiler, the jaxlib version (its FFI headers) and the CPU's
feature flags. Builds write to a temporary file and rename it into place, so concurrent
processes (pytest workers, hosts sharing a home directory) never load a half-written library.

A cached library is loaded only if it is the one this user built: the cache directory must be
the user's and writable by no one else (else a one-line ``KernelBuildError``), and the library's
sha256 must match the one recorded beside it (``<name>.so.sha256``) when it was built; a library
that does not match (planted, or damaged) is rebuilt over, never loaded.

Environment:
  DAGMOE_KERNEL_CACHE: cache directory (default ``~/.cache/dagmoe_jax/kernels``).
  CXX: the C++ compiler (default: the first of g++, c++, clang++ on PATH).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Optional

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
    the headers beside it (``cpu_common.h``), flags, compiler, jaxlib version and CPU."""
    import jaxlib

    key = hashlib.sha256()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    for part in (source.read_bytes(), headers, " ".join(FLAGS).encode(), cxx.encode(),
                 jaxlib.__version__.encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def check_private(path: Path) -> None:
    """``path`` (the cache directory or a file in it) must belong to this user and be writable
    by no one else; a one-line ``KernelBuildError`` says how to fix it otherwise."""
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KernelBuildError(f"the kernel cache {path} belongs to another user: set "
                               f"DAGMOE_KERNEL_CACHE to a directory of your own")
    if st.st_mode & 0o022:
        raise KernelBuildError(f"the kernel cache {path} is writable by other users: run "
                               f"'chmod go-w {path}' or set DAGMOE_KERNEL_CACHE to a private "
                               f"directory")


def _trusted(target: Path) -> bool:
    """Whether the cached ``target`` is the library this user built (its recorded digest)."""
    digest = _digest_path(target)
    if not (target.exists() and digest.exists()):
        return False
    check_private(target)
    check_private(digest)
    return digest.read_text().strip() == _sha256(target)


def is_built(source: Path) -> bool:
    """Whether ``source`` is already compiled in the cache (no compiler: False)."""
    cxx = compiler()
    if cxx is None:
        return False
    target = target_path(source, cxx)
    return target.exists() and _digest_path(target).exists()


def build(source: Path) -> Path:
    """Return the path of ``source`` compiled into a shared library, compiling it if needed."""
    import jax

    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (install g++ or set CXX)")
    include = jax.ffi.include_dir()
    target = target_path(source, cxx)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(target.parent)
    if _trusted(target):
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    fd, tmp_digest = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, "-isystem", include, str(source), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            first = " | ".join(proc.stderr.strip().splitlines()[:3])
            raise KernelBuildError(f"{cxx} failed on {source.name}: {first}")
        os.chmod(tmp, 0o755)
        Path(tmp_digest).write_text(_sha256(Path(tmp)) + "\n")
        os.chmod(tmp_digest, 0o644)
        os.replace(tmp, target)
        os.replace(tmp_digest, _digest_path(target))
    finally:
        for path in (tmp, tmp_digest):
            if os.path.exists(path):
                os.unlink(path)
    return target


def load_ffi_targets(source: Path, targets: Dict[str, str]) -> Optional[str]:
    """Build ``source`` (:func:`build`), load it and register each XLA FFI custom-call target
    ``{target name: exported symbol}`` on CPU. None on success, else why it cannot be used
    (no compiler, a failed build, a library that does not load). Callers cache the result so
    that this runs once per process."""
    import jax  # pylint: disable=import-outside-toplevel

    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source)))
    except (KernelBuildError, OSError) as err:
        return str(err)
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return None
