"""Command-line helpers shared by ``train.py`` and the benchmarks (import-light: no JAX)."""

from __future__ import annotations

import argparse
from typing import Any, Dict, Iterable, List, Tuple


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


def add_budget_flags(parser: argparse.ArgumentParser, defaults: Dict[str, Any]) -> None:
    """One ``--NAME`` flag per entry of ``defaults``, typed like its default value; unset flags
    stay None for :func:`fill_budget_defaults`."""
    for name, value in defaults.items():
        parser.add_argument(f"--{name}", type=type(value), default=None)


def fill_budget_defaults(args: argparse.Namespace, defaults: Dict[str, Any],
                         micro: Dict[str, Any]) -> None:
    """Give each flag the user left unset its default: from ``micro`` when ``args.micro`` is set
    (a quick end-to-end budget), else from ``defaults``."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, micro.get(name, value) if args.micro else value)
