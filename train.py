"""Train or evaluate a model from a checkout: ``python train.py --help``.

The command line lives in :mod:`dagmoe_jax.cli.train`; after ``pip install`` the same
command is ``dagmoe-train`` (or ``python -m dagmoe_jax.cli.train``). Like every command it
starts under the stop contract of :mod:`dagmoe_jax.stopping` (standard library only): a signal
before training begins is one line and exit 130, from the first line on.
"""

import sys

from dagmoe_jax.stopping import install, run_command  # standard library only
from dagmoe_jax.train.signals import stopped_before_training  # standard library only

install(stopped_before_training)

from dagmoe_jax.cli.train import entry_main  # noqa: E402  (after the handlers: from the first line)

if __name__ == "__main__":
    sys.exit(run_command(entry_main))
