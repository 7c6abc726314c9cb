"""Logical axis names and their mapping onto the device mesh (DESIGN.md section 8)."""

from dagmoe_jax.parallel.axes import DEFAULT_RULES, constrain, logical_to_spec

__all__ = ["DEFAULT_RULES", "constrain", "logical_to_spec"]
