"""The batch: one typed dict from every data stream to the model and the losses.

Its keys keep one name from the stream that makes them to the function that reads them (the
model's argument is ``segment_ids``, and so is the batch's key; grain's packers call the same
ids ``tokens_segment_ids`` inside the pipeline, which turns them into this batch). Every
stream yields :class:`Batch`es: the pre-training stream and the held-out batches
(:mod:`~dagmoe_jax.data.pipeline`), the SFT batches (:mod:`~dagmoe_jax.data.instruct`) and the
synthetic tasks' answer batches; a block family's per-token annotations ride along under its
own keys (:class:`~dagmoe_jax.data.extension.Annotator`, DoE's ``topics``).
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np


class Batch(TypedDict, total=False):
    """A batch of B rows of S positions (host arrays; the run puts :data:`MODEL_INPUTS` on
    the devices).

    inputs: int32 [B, S], the token ids the model reads.
    targets: int32 [B, S], the token to predict at each position (``inputs`` shifted by one).
    mask: bool [B, S], the positions trained on or scored (absent: all).
    segment_ids: int32 [B, S], packed examples or documents: equal nonzero ids are one
      example (a contiguous run), 0 is padding; attention stays within an example (absent:
      one sequence per row).
    task_id, size: int32 [B], a task answer batch's task (index into the stream's task names)
      and problem size (host bookkeeping, not model inputs).
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    segment_ids: np.ndarray
    task_id: np.ndarray
    size: np.ndarray


# The entries of a batch that the model and the losses read, besides a block family's
# per-token annotations; the others stay on the host. ``segment_ids`` travels only when a batch
# has it.
MODEL_INPUTS = ("inputs", "targets", "mask", "segment_ids")
