"""The CoE block's parameters and FLOPs: C iterations of K_t experts, one router per
iteration (one with ``shared_router``), and the iterations' scales a_t (the conventions of
:mod:`dagmoe_jax.model.accounting`)."""

from __future__ import annotations

from dagmoe_jax.config import ModelConfig
# The chain's grouped matmuls are the MoE's: the routed experts' d_r wide.
from dagmoe_jax.families.moe.accounting import grouped_matmul_width  # noqa: F401
from dagmoe_jax.model.accounting import Counts, routed_counts


def layer_counts(cfg: ModelConfig) -> Counts:
    """One layer: the routers (a shared one runs once), C K_t routed expert calls, the shared
    experts once per iteration, and a_t for every iteration after the first."""
    c = cfg.block
    return routed_counts(cfg, steps=c.iterations, k=c.resolved_top_k,
                         routers=1 if c.shared_router else c.iterations,
                         scales=c.iterations - 1 if c.iteration_scales else 0)
