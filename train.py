"""Train or evaluate a model from a checkout: ``python train.py --help``.

The command line lives in :mod:`dagmoe_jax.train.__main__`; after ``pip install`` the same
command is ``dagmoe-train`` (or ``python -m dagmoe_jax.train``).
"""

import sys

from dagmoe_jax.train.__main__ import entry

if __name__ == "__main__":
    sys.exit(entry())
