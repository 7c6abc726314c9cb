"""Scoring token sequences for evaluation requests, for any model of the library.

* :func:`padded_width`: the compiled width of a batch of rows (few compiled shapes serve
  every row).
"""

from __future__ import annotations

MIN_WIDTH = 16


def padded_width(length: int, max_length: int) -> int:
    """The compiled width for a batch whose longest row has ``length`` inputs: the next power
    of two (at least :data:`MIN_WIDTH`), capped at ``max_length`` (few compiled shapes serve
    every row: the harness's scoring, DUME's prompt statistics)."""
    return min(max(MIN_WIDTH, 1 << max(length - 1, 0).bit_length()), max_length)
