"""Decoupling of Experts (DoE; docs/design.md section 6): its configuration.

The block itself is :mod:`dagmoe_jax.doe.block`, Stage 1's topics :mod:`dagmoe_jax.doe.topics`
and its analysis :mod:`dagmoe_jax.doe.analysis`.
"""

from dagmoe_jax.doe.config import DoEConfig, TopicConfig

__all__ = ["DoEConfig", "TopicConfig"]
