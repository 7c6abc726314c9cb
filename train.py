"""Train or evaluate a model from a checkout: ``python train.py --help``.

The command line lives in :mod:`dagmoe_jax.cli.train`; after ``pip install`` the same
command is ``dagmoe-train`` (or ``python -m dagmoe_jax.cli.train``).
"""

import os
import signal
import sys

from dagmoe_jax.train.signals import stopped_before_training  # standard library only


def _stop_at_once(signum, frame):
    """Until the command installs its own handlers: a signal ends it in one line (nothing
    has been written yet)."""
    del frame
    sys.stderr.write(stopped_before_training(signal.Signals(signum).name) + "\n")
    os._exit(130)


signal.signal(signal.SIGINT, _stop_at_once)
signal.signal(signal.SIGTERM, _stop_at_once)

from dagmoe_jax.cli.train import entry  # noqa: E402  (after the handlers: from the first line)

if __name__ == "__main__":
    sys.exit(entry())
