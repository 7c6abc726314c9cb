"""Run-directory paths, local or in cloud storage, through ``etils.epath``.

A run directory may be a local path, a ``file://`` URI, or a cloud URI (``gs://bucket/run``,
``s3://``, ``az://``) that ``etils.epath`` reaches through fsspec (or TensorFlow's gfile when
TensorFlow is installed). The filesystem package a cloud scheme needs is not a dependency of
dagmoe_jax: :func:`run_path` checks that it is there before anything is written, and says in one
line which package to install, rather than letting a path such as ``gs://b/run`` turn into a
local directory named ``gs:``.

A command's output directory is written whole or not at all (:func:`staged_directory`): into a
hidden sibling, moved into place when it is complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Union

from etils import epath

PathLike = Union[str, os.PathLike]

# The package each cloud scheme needs (what fsspec asks for), for the one-line error.
FILESYSTEM_PACKAGES = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs"}


def scheme(path: PathLike) -> str:
    """The URI scheme of ``path`` ('gs', 's3', ...), or '' for a local path."""
    text = os.fspath(path)
    return text.split("://", 1)[0] if "://" in text else ""


def is_remote(path: PathLike) -> bool:
    """Whether ``path`` is in cloud storage (a scheme other than ``file``)."""
    return scheme(path) not in ("", "file")


def as_path(path: PathLike) -> epath.Path:
    """``path`` as an ``epath.Path``: a ``file://`` URI becomes its local path, a local path or
    a cloud URI is kept. An unknown scheme is a one-line ``ValueError``."""
    text = os.fspath(path)
    kind = scheme(text)
    if kind == "file":
        text = text[len("file://"):]
    elif kind and kind not in FILESYSTEM_PACKAGES:
        raise ValueError(f"{text}: the {kind}:// scheme is not supported: use a local path, "
                         f"file://, " + ", ".join(f"{s}://" for s in FILESYSTEM_PACKAGES))
    return epath.Path(text)


def run_path(run_dir: PathLike) -> epath.Path:
    """:func:`as_path` of a run directory, after checking that its filesystem can be reached:
    a cloud URI whose filesystem package is not installed is a one-line ``ValueError`` naming
    the package (nothing is created, here or locally)."""
    path = as_path(run_dir)
    kind = scheme(path)
    if kind:
        try:
            path.exists()
        except ImportError as err:
            package = FILESYSTEM_PACKAGES[kind]
            raise ValueError(f"--run_dir={os.fspath(run_dir)} needs the {package} package to "
                             f"reach {kind}:// storage ({err}): pip install {package}, or use a "
                             f"local directory") from None
    return path


def partial_path(target: PathLike, merge: bool = False) -> Path:
    """Where :func:`staged_directory` writes ``target`` until it is complete: the hidden
    sibling ``.<name>.partial``, or with ``merge`` into a directory that exists, a hidden
    directory of that name inside it (its files are moved from there, on the same filesystem,
    and writing needs no more than the directory itself)."""
    target = Path(os.path.expanduser(os.fspath(target))).absolute()
    name = f".{target.name}.partial"
    return target / name if merge and target.is_dir() else target.with_name(name)


@contextlib.contextmanager
def staged_directory(target: PathLike, *, merge: bool = False) -> Iterator[Path]:
    """Write the local directory ``target`` whole or not at all: yields :func:`partial_path`
    (created empty; a leftover of an earlier attempt is removed first) to write into; when the
    block ends normally it is renamed to ``target``, which must be absent or an empty directory
    (else a one-line ``ValueError`` before anything is written). ``merge``: ``target`` may hold
    files already; the block's files are moved into it one at a time (each replacing the file
    of its name; directories merged alike), the rest kept. On any exception (Ctrl-C's
    ``KeyboardInterrupt`` included) the staged files are removed and ``target`` is as it was;
    a staging directory that cannot be created is a one-line ``ValueError``. A command that
    stops on a signal without an exception (:mod:`dagmoe_jax.stopping`) registers both paths
    for removal."""
    target = Path(os.path.expanduser(os.fspath(target))).absolute()
    there = target.is_symlink() or target.exists()
    if there and (not target.is_dir() or (not merge and any(target.iterdir()))):
        raise ValueError(f"{target} already exists and is not "
                         f"{'a directory' if merge else 'an empty directory'}: choose a new "
                         f"path")
    partial = partial_path(target, merge)
    inside = partial.parent == target
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
    except OSError as err:
        raise ValueError(f"cannot write {target} ({err.strerror or err}): choose a writable "
                         f"path") from None
    try:
        yield partial
        if inside:
            _move_into(partial, target)
        else:
            if target.is_dir() and not target.is_symlink():
                target.rmdir()                  # empty: OSError (kept) where it is not
            partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _move_into(source: Path, target: Path) -> None:
    """Move the files of directory ``source`` into directory ``target`` (each replacing the
    file of its name, directories merged alike) and remove ``source``."""
    for entry in sorted(source.iterdir()):
        there = target / entry.name
        if entry.is_dir() and not entry.is_symlink() and there.is_dir() \
                and not there.is_symlink():
            _move_into(entry, there)
        else:
            if there.is_dir() and not there.is_symlink():
                shutil.rmtree(there)
            os.replace(entry, there)
    source.rmdir()
