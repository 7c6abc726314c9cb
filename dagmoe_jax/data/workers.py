"""grain worker processes: what each needs when it starts (shared by the pre-training and
the instruction pipelines)."""

from __future__ import annotations

import os
import threading
import time


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
