"""``python -m dagmoe_jax.harness``: :mod:`dagmoe_jax.harness.cli`."""

from dagmoe_jax.harness.cli import entry

if __name__ == "__main__":
    entry()
