"""Evaluation batches from packed rows: every process the same number of batches.

The streams pack with grain's packers (concat-then-split for pre-training text,
``FirstFitPackIterDataset`` for whole conversations; :mod:`~dagmoe_jax.data.pipeline`,
:mod:`~dagmoe_jax.data.instruct`). Evaluation reads its rows once, in order, and groups them
here into global batches whose last one is filled with rows that score nothing, so that every
process keeps its own block of rows of the same batches.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import numpy as np


def global_batches(rows: Iterable[Dict[str, np.ndarray]], batch_size: int, process_index: int,
                   process_count: int, fill: Optional[Dict[str, object]] = None
                   ) -> List[Dict[str, np.ndarray]]:
    """``rows`` (dicts of one row's [S] arrays) grouped into global batches of ``batch_size``
    rows, the last completed with rows that score nothing (each key's ``fill`` value, else 0:
    a mask of False, padding ids), of which this process keeps rows ``[process_index * B,
    (process_index + 1) * B)``, B = ``batch_size // process_count``."""
    rows, fill = list(rows), fill or {}
    if not rows:
        return []
    empty = {k: np.full_like(v, fill.get(k, 0)) for k, v in rows[0].items()}
    rows += [empty] * (-len(rows) % batch_size)
    local = batch_size // process_count
    block = slice(process_index * local, (process_index + 1) * local)
    return [{k: np.stack([row[k] for row in rows[b:b + batch_size][block]]) for k in rows[0]}
            for b in range(0, len(rows), batch_size)]
