"""Chain-of-Experts block (CoE eq. 4-10; DESIGN.md section 5).

C iterations over one shared expert pool. Iteration t routes the previous state x^(t-1) with its
own router to K_t experts (default K / C) and adds their gated outputs (plus shared experts):

* 'inner' (eq. 5, default): x^(t) = sum_i g_t,i E_i(x^(t-1)) + x^(t-1);  y = x^(C)
* 'outer' (eq. 9):          x^(t) = sum_i g_t,i E_i(x^(t-1));            y = x^(C) + x
* 'init'  (eq. 10):         x^(t) = sum_i g_t,i E_i(x^(t-1)) + x^(0);    y = x^(C)

``shared_router`` is the eq. 8 ablation: the first iteration's routing (gates and experts) is
reused by every iteration instead of re-routing each refined state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.model.aggregation import weighted_sum
from dagmoe_jax.model.experts import Experts
from dagmoe_jax.model.layers import dtype_of
from dagmoe_jax.model.moe import block_stats, make_shared
from dagmoe_jax.model.router import Router


def coe_residual(update: jax.Array, prev: jax.Array, x0: jax.Array, mode: str) -> jax.Array:
    """One CoE step's residual: eq. 5 ('inner'), eq. 9 ('outer') or eq. 10 ('init')."""
    if mode == "inner":
        return update + prev
    if mode == "init":
        return update + x0
    return update


class CoEBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e, c = cfg.experts, cfg.coe
        num_routers = 1 if c.shared_router else c.iterations
        self.routers = nnx.List([Router(cfg.d_model, e.num_experts, cfg.init_std, rngs=rngs)
                                 for _ in range(num_routers)])
        self.experts = Experts(e.num_experts, cfg.d_model, e.expert_hidden, cfg.init_std,
                               dtype_of(cfg.compute_dtype), rngs=rngs)
        self.shared = make_shared(cfg, rngs=rngs)

    def __call__(self, x: jax.Array):
        cfg, r, c = self.cfg, self.cfg.router, self.cfg.coe
        b, s, d = x.shape
        x0 = x.reshape(b * s, d)
        h, stats, routing = x0, [], None
        for t in range(c.iterations):
            if t == 0 or not c.shared_router:
                routing = self.routers[t](h, cfg.coe_top_k, r.score_fn, r.renormalize)
            out, keep = self.experts(h, routing.indices, cfg.experts.dispatch,
                                     cfg.experts.capacity_factor)
            update = weighted_sum(routing.gates, out)
            if self.shared is not None:
                update = update + self.shared(h)
            h = coe_residual(update.astype(x.dtype), h, x0, c.residual)
            stats.append(block_stats(Router.losses(routing, r.score_fn), keep))
        y = h + x0 if c.residual == "outer" else h
        mean_stats = jax.tree.map(lambda *v: jnp.mean(jnp.stack(v), axis=0), *stats)
        return y.reshape(b, s, d), mean_stats
