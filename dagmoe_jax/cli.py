"""Command-line helpers shared by ``train.py`` and the benchmarks (import-light: no JAX)."""

from __future__ import annotations

from typing import Iterable, List, Tuple


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
