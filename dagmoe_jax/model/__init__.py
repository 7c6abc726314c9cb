"""Flax NNX modules of the DAG-MoE decoder: attention, the blocks of each family (dense, MoE with
its router, dispatch, experts and aggregation, Chain-of-Experts, DoE) and the Transformer."""

from dagmoe_jax.model.transformer import BLOCKS, Transformer

__all__ = ["BLOCKS", "Transformer"]
