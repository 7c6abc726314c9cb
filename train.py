"""Train or evaluate a model from a checkout: ``python train.py --help``.

The command line lives in :mod:`dagmoe_jax.cli.train`; after ``pip install`` the same
command is ``dagmoe-train`` (or ``python -m dagmoe_jax.cli.train``).
"""

import sys

from dagmoe_jax.cli.train import entry

if __name__ == "__main__":
    sys.exit(entry())
