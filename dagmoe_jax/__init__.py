"""dagmoe_jax: DAG-MoE and related Mixture-of-Experts language models in JAX / Flax NNX."""

import importlib

from dagmoe_jax.platform import cpu_where_no_accelerator

cpu_where_no_accelerator()        # before JAX loads: no accelerator plugin starts on a CPU host

__version__ = "0.1.0"

# The configs a notebook starts from, loaded when first asked for (PEP 562): importing the
# package loads nothing else, so a command's stop handlers (dagmoe_jax/stopping.py) are in
# place a few milliseconds after the interpreter starts.
_EXPORTS = {"ModelConfig": "dagmoe_jax.config", "RouterConfig": "dagmoe_jax.config",
            "ExpertConfig": "dagmoe_jax.config",
            "AggregationConfig": "dagmoe_jax.families.moe.config",
            "CoEConfig": "dagmoe_jax.families.coe.config",
            "DoEConfig": "dagmoe_jax.families.doe.config"}

__all__ = ["AggregationConfig", "CoEConfig", "DoEConfig", "ExpertConfig", "ModelConfig",
           "RouterConfig", "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dagmoe_jax' has no attribute {name!r}")
