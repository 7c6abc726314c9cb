"""The MoE block's parameters and FLOPs: router, routed and shared experts, and the aggregator
(the DAG module or the MLP mixer; the conventions of :mod:`dagmoe_jax.model.accounting`)."""

from __future__ import annotations

from dagmoe_jax.config import ModelConfig, aggregation_of
from dagmoe_jax.families.moe.budget import dag_params_per_layer
from dagmoe_jax.model.accounting import Counts, routed_counts


def aggregator_params(cfg: ModelConfig) -> int:
    """Parameters of one layer's aggregator: the DAG module or the MLP mixer (0 for 'sum')."""
    a = aggregation_of(cfg.block)
    if a is None or a.kind == "sum":
        return 0
    if a.kind == "dag":
        return dag_params_per_layer(cfg.d_model, a.dag_dim, a.dag_iters, a.dag_shared_weights)
    return 3 * cfg.d_model * a.dag_dim


def aggregator_forward_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(matmul, pairwise) forward FLOPs per token of one layer's aggregator."""
    a = aggregation_of(cfg.block)
    if a is None or a.kind == "sum":
        return 0.0, 0.0
    d, k = cfg.d_model, cfg.block.router.top_k
    if a.kind == "dag":
        dg, pairs = a.dag_dim, k if a.dag_edges == "self" else k * k   # 'self': K pairs
        return (a.dag_iters * k * (4 * d * dg + 8 * dg * dg),
                a.dag_iters * 4 * pairs * dg)
    return 6.0 * d * a.dag_dim, 0.0


def layer_counts(cfg: ModelConfig) -> Counts:
    """One layer: a router, K of the routed experts, the shared experts and the aggregator."""
    counts = routed_counts(cfg, steps=1, k=cfg.block.router.top_k, routers=1)
    counts.params["aggregator"] = counts.active["aggregator"] = aggregator_params(cfg)
    matmul, pairwise = aggregator_forward_flops(cfg)
    counts.flops.update(aggregator=matmul, dag_pairwise=pairwise)
    return counts


def grouped_matmul_width(cfg: ModelConfig) -> int:
    """The hidden width of the grouped matmuls the block runs: the routed experts' d_r."""
    return cfg.block.experts.expert_hidden
