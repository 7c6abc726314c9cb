"""Flax NNX modules of the DAG-MoE decoder."""

from dagmoe_jax.model.transformer import Transformer

__all__ = ["Transformer"]
