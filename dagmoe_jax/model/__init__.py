"""Flax NNX modules of the DAG-MoE decoder: attention, the blocks of each family (dense, MoE with
its router, dispatch, experts and aggregation, Chain-of-Experts, DoE), the Transformer, and
:func:`~dagmoe_jax.model.settle.settle`, which decides how it runs on this machine."""

from dagmoe_jax.model.settle import describe, settle
from dagmoe_jax.model.transformer import BLOCKS, Transformer

__all__ = ["BLOCKS", "Transformer", "describe", "settle"]
