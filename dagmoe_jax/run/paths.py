"""Run-directory paths, local or in cloud storage, through ``etils.epath``.

A run directory may be a local path, a ``file://`` URI, or a cloud URI (``gs://bucket/run``,
``s3://``, ``az://``) that ``etils.epath`` reaches through fsspec (or TensorFlow's gfile when
TensorFlow is installed). The filesystem package a cloud scheme needs is not a dependency of
dagmoe_jax: :func:`run_path` checks that it is there before anything is written, and says in one
line which package to install, rather than letting a path such as ``gs://b/run`` turn into a
local directory named ``gs:``.
"""

from __future__ import annotations

import os
from typing import Union

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
