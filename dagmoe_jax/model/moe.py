"""The MoE block: router -> experts -> aggregator (sum, DAG or MLP) + shared experts."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.model.aggregation import make_aggregator
from dagmoe_jax.model.experts import Experts
from dagmoe_jax.model.layers import SwiGLU, dtype_of
from dagmoe_jax.model.router import Router
from dagmoe_jax.parallel.axes import MeshLayout


def make_shared(cfg: ModelConfig, *, rngs: nnx.Rngs) -> Optional[SwiGLU]:
    e = cfg.experts
    if e.num_shared == 0:
        return None
    return SwiGLU(cfg.d_model, e.num_shared * e.shared_hidden, cfg.init_std,
                  dtype_of(cfg.compute_dtype), fuse_gate_up=cfg.execution.fuse_gate_up, rngs=rngs)


def make_experts(cfg: ModelConfig, layout: Optional[MeshLayout], *, rngs: nnx.Rngs) -> Experts:
    """The routed experts of ``cfg`` (a settled config), dispatched across ``layout``."""
    e = cfg.experts
    return Experts(e.num_experts, cfg.d_model, e.expert_hidden, cfg.init_std,
                   dtype_of(cfg.compute_dtype), mode=e.dispatch,
                   capacity_factor=e.capacity_factor, fuse_gate_up=cfg.execution.fuse_gate_up,
                   layout=layout, grouped_matmul=cfg.execution.grouped_matmul,
                   expert_exchange=cfg.execution.expert_exchange, rngs=rngs)


def block_stats(losses: dict, keep: jax.Array) -> dict:
    """The auxiliary outputs every routed block reports (losses unweighted)."""
    # mean of the dropped mask, not 1 - mean(keep): exactly 0 (never -3e-8) when nothing drops
    return {**losses, "dropped_fraction": jnp.mean(jnp.logical_not(keep).astype(jnp.float32))}


class MoEBlock(nnx.Module):
    """y = Aggregate(x, g, E(x)) + sum of shared experts(x), for x [B, S, d].

    With ``record_intermediates`` on, the stats also hold ``record``: the routed expert ids
    ``indices`` [1, T, K] (rank order) and the aggregator's own record (the DAG's edge gates).
    """

    def __init__(self, cfg: ModelConfig, layout: Optional[MeshLayout] = None, *,
                 rngs: nnx.Rngs):
        self.router = Router.from_config(cfg.d_model, cfg.experts.num_experts, cfg.init_std,
                                         cfg.router, top_k=cfg.router.top_k, rngs=rngs)
        self.experts = make_experts(cfg, layout, rngs=rngs)
        self.aggregator = make_aggregator(cfg, rngs=rngs)
        self.shared = make_shared(cfg, rngs=rngs)
        self.record_intermediates = False     # analysis switches it on (Module.set_attributes)

    def __call__(self, x: jax.Array):
        b, s, d = x.shape
        xt = x.reshape(b * s, d)
        routing = self.router(xt)
        expert_out, keep = self.experts(xt, routing.indices)
        y, kept = self.aggregator(xt, routing.gates, expert_out)
        if self.shared is not None:
            y = y + self.shared(xt)
        stats = block_stats(self.router.losses(routing), keep)
        if self.record_intermediates:
            stats["record"] = {"indices": routing.indices[None], **kept}
        return y.reshape(b, s, d).astype(x.dtype), stats
