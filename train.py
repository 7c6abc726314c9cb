"""Train or evaluate a model from a checkout: ``python train.py --help``.

The command line lives in :mod:`dagmoe_jax.cli.train`; after ``pip install`` the same
command is ``dagmoe-train`` (or ``python -m dagmoe_jax.cli.train``). Like every command it
starts under the stop contract of :mod:`dagmoe_jax.stopping` (standard library only): a signal
before training begins is one line and exit 130, from the first lines on (the allocator is
set up just before it, as in ``dagmoe-train``).
"""

import sys

from dagmoe_jax.run.allocator import configure_allocator  # standard library only

# Before any thread starts: the contract's watcher thread, started by install(), would take a
# malloc arena of its own that glibc's one-arena tuning then hands to XLA's threads, whose
# buffers came back as fresh pages every step (dagmoe_jax/run/allocator.py).
configure_allocator()

from dagmoe_jax.stopping import install, run_command  # noqa: E402  (standard library only)
from dagmoe_jax.train.signals import stopped_before_training  # noqa: E402

install(stopped_before_training)

from dagmoe_jax.cli.train import entry_main  # noqa: E402  (after the handlers: from the first line)

if __name__ == "__main__":
    sys.exit(run_command(entry_main))
