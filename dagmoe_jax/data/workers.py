"""grain worker processes: what each needs when it starts, and the end every training stream
shares (:func:`finish_stream`; the pre-training and the instruction pipelines)."""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Optional

import grain

from dagmoe_jax.data.tokenizers import CheckTokens


def finish_stream(it: grain.IterDataset, worker_count: int,
                  vocab_size: Optional[int] = None) -> grain.IterDataset:
    """A training stream's last steps: its batches' token ids checked against ``vocab_size``
    (the model's, :class:`~dagmoe_jax.data.tokenizers.CheckTokens`; None: not checked) and,
    with ``worker_count`` W > 0, the stream made in W grain worker processes that exit when
    this process is gone."""
    if vocab_size is not None:
        it = it.map(CheckTokens(vocab_size))
    if worker_count:
        _absl_flags_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count),
                            worker_init_fn=functools.partial(_exit_with_parent, os.getpid()))
    return it


def _exit_with_parent(parent: int, worker: int, workers: int) -> None:
    """Run in each grain worker process: exit as soon as the process that started it is gone.
    A training process killed with SIGKILL cannot stop its workers, which otherwise live on,
    orphaned, holding memory and shared-memory buffers. (A watcher thread rather than
    ``PR_SET_PDEATHSIG``, which fires when the *thread* that started the worker ends, and grain
    starts workers from a thread pool.)"""
    del worker, workers

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _absl_flags_parsed() -> None:
    """grain's worker processes read absl flags; outside ``absl.app.run`` nothing parsed them
    and the first batch fails with ``UnparsedFlagAccessError`` (grain issues #1355 / #1360).
    Marking them parsed keeps every flag at its default."""
    from absl import flags  # pylint: disable=import-outside-toplevel

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
