"""The dense block's parameters and FLOPs (the conventions of
:mod:`dagmoe_jax.model.accounting`)."""

from __future__ import annotations

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.model.accounting import Counts


def layer_counts(cfg: ModelConfig) -> Counts:
    """One layer's SwiGLU: 3 d f weights, all active."""
    weights = 3 * cfg.d_model * cfg.resolved_ffn_hidden
    return Counts({"dense_ffn": weights}, {"dense_ffn": weights}, {"dense_ffn": 2.0 * weights})


def grouped_matmul_width(cfg: ModelConfig) -> int:
    """The hidden width of the grouped matmuls the block runs: none, so d_model (what
    ``ExecutionConfig.grouped_matmul`` settles to is never used)."""
    return cfg.d_model
