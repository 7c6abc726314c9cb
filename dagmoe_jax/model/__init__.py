"""Flax NNX modules of the DAG-MoE decoder: attention, what the block families share (the
router, dispatch, experts, the aggregators and the DAG module), the Transformer, and
:func:`~dagmoe_jax.model.settle.settle`, which decides how it runs on this machine. Each
family's block is in its own package (``dagmoe_jax.families.<kind>.block``), found through
the registry (:mod:`dagmoe_jax.config.families`)."""

from dagmoe_jax.model.settle import describe, settle
from dagmoe_jax.model.transformer import Transformer, block_class

__all__ = ["Transformer", "block_class", "describe", "settle"]
