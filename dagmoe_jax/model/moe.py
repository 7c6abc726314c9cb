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


def make_shared(cfg: ModelConfig, *, rngs: nnx.Rngs) -> Optional[SwiGLU]:
    e = cfg.experts
    if e.num_shared == 0:
        return None
    return SwiGLU(cfg.d_model, e.num_shared * e.shared_hidden, cfg.init_std,
                  dtype_of(cfg.compute_dtype), rngs=rngs)


def block_stats(losses: dict, keep: jax.Array) -> dict:
    """The auxiliary outputs every routed block reports (losses unweighted)."""
    # mean of the dropped mask, not 1 - mean(keep): exactly 0 (never -3e-8) when nothing drops
    return {**losses, "dropped_fraction": jnp.mean(jnp.logical_not(keep).astype(jnp.float32))}


class MoEBlock(nnx.Module):
    """y = Aggregate(x, g, E(x)) + sum of shared experts(x), for x [B, S, d]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e = cfg.experts
        self.router = Router(cfg.d_model, e.num_experts, cfg.init_std, rngs=rngs)
        self.experts = Experts(e.num_experts, cfg.d_model, e.expert_hidden, cfg.init_std,
                               dtype_of(cfg.compute_dtype), rngs=rngs)
        self.aggregator = make_aggregator(cfg, rngs=rngs)
        self.shared = make_shared(cfg, rngs=rngs)

    def __call__(self, x: jax.Array):
        cfg, r = self.cfg, self.cfg.router
        b, s, d = x.shape
        xt = x.reshape(b * s, d)
        routing = self.router(xt, r.top_k, r.score_fn, r.renormalize)
        expert_out, keep = self.experts(xt, routing.indices, cfg.experts.dispatch,
                                        cfg.experts.capacity_factor)
        y = self.aggregator(xt, routing.gates, expert_out)
        if self.shared is not None:
            y = y + self.shared(xt)
        losses = Router.losses(routing, r.balance_load, r.balance_prob)
        return y.reshape(b, s, d).astype(x.dtype), block_stats(losses, keep)
