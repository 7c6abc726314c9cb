"""Flax NNX modules of the DAG-MoE decoder, and the hooks of a model's block family."""

from dagmoe_jax.model.transformer import Transformer, extension_for

__all__ = ["Transformer", "extension_for"]
