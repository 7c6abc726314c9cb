"""Flax NNX modules of the decoder every family shares: attention, the Transformer, the
routed-expert parts the routed families build on (:mod:`dagmoe_jax.model.routed`: router,
dispatch, experts) and :func:`~dagmoe_jax.model.settle.settle`, which decides how it runs on
this machine. Each family's block, and what only it uses (the MoE family's aggregators and
DAG module), is in its own package (``dagmoe_jax.families.<kind>``), found through the
registry (:mod:`dagmoe_jax.config.families`)."""

from dagmoe_jax.model.settle import describe, settle
from dagmoe_jax.model.transformer import Transformer, block_class

__all__ = ["Transformer", "block_class", "describe", "settle"]
