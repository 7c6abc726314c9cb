"""Chain-of-Experts block (CoE eq. 4-10; docs/design.md section 5).

C iterations over one shared expert pool. Iteration t routes the previous state x^(t-1) with its
own router to K_t experts (default K / C) and adds their gated outputs (plus shared experts):

* 'inner' (eq. 5, default): x^(t) = sum_i g_t,i E_i(x^(t-1)) + x^(t-1);  y = x^(C)
* 'outer' (eq. 9):          x^(t) = sum_i g_t,i E_i(x^(t-1));            y = x^(C) + x
* 'init'  (eq. 10):         x^(t) = sum_i g_t,i E_i(x^(t-1)) + x^(0);    y = x^(C)

``CoEConfig.score_fn='softmax'`` gives the routers CoE eq. 7's softmax (the model's score
function otherwise). ``CoEConfig.iteration_scales`` scales each later iteration's update by a
learned a_t (a converted MoE starts at 0). ``shared_router`` is the eq. 8 ablation: the first
iteration's routing (gates and experts) is reused by every iteration instead of re-routing
each refined state.

In every residual mode the chain's output is x + delta, with delta what the experts added
(:func:`coe_step`). x = RMSNorm(h) is the block input and the decoder adds h around the block,
so ``CoEConfig.stream`` decides how often x reaches the stream (:func:`coe_block_output`):
'once' (default) returns delta, 'literal' x + delta, 'reference' x + delta in place of h.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.families.moe.aggregation import weighted_sum
from dagmoe_jax.model.block import BlockInputs, routed_stats
from dagmoe_jax.model.layers import make_param
from dagmoe_jax.families.moe.block import routed_experts, shared_experts
from dagmoe_jax.model.routed.router import Router
from dagmoe_jax.parallel.axes import MeshLayout


def coe_step(update: jax.Array, delta: jax.Array, x0: jax.Array, mode: str):
    """One CoE iteration's residual, eq. 5 ('inner'), eq. 10 ('init') or eq. 9 ('outer').

    The state is written x^(t) = x^(0) + delta_t ('inner', 'init') or x^(t) = delta_t
    ('outer'), with ``update`` = sum_i g_t,i E_i(x^(t-1)) (+ shared experts):
    'inner' x^(t) = update + x^(t-1), so delta_t = delta_(t-1) + update;
    'init'  x^(t) = update + x^(0),   so delta_t = update;
    'outer' x^(t) = update,           so delta_t = update (eq. 9's output adds x^(0) once).
    Returns (delta_t, x^(t)): either way the chain's output is x^(0) + delta_C.
    """
    delta = delta + update if mode == "inner" else update
    return delta, (delta if mode == "outer" else x0 + delta)


def coe_block_output(delta: jax.Array, x0: jax.Array, stream: str) -> jax.Array:
    """The block output for ``CoEConfig.stream``: the chain's output x^(0) + delta ('literal',
    'reference'), or only the experts' delta ('once', so the layer h + delta counts x once)."""
    return delta if stream == "once" else x0 + delta


class CoEBlock(nnx.Module):
    """Chain-of-Experts: C iterations of routing, experts and the residual of ``residual``
    over the chain (module docstring); stats are the iterations' means (but ``router_counts``:
    each router's own assignments, [routers, N]), and with
    ``record_intermediates`` on the record holds the expert ids of every iteration [C, T, K]."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig,
                 layout: Optional[MeshLayout] = None, *, rngs: nnx.Rngs):
        c = cfg.block
        self.iterations, self.residual, self.stream = c.iterations, c.residual, c.stream
        self.replaces_stream = c.stream == "reference"     # the layer's output is the block's
        self.shared_router = c.shared_router
        self.routers = nnx.List([
            Router(c.iteration_router, cfg.d_model, c.experts.num_experts, std=cfg.init_std,
                   top_k=c.resolved_top_k, rngs=rngs)
            for _ in range(1 if c.shared_router else c.iterations)])
        # CoEConfig.iteration_scales: a_t of iterations 2..C, [C - 1], 1 in a fresh model (not
        # weight-decayed: a 'scale', run/optim.decay_mask)
        self.iteration_scales = (
            make_param(rngs, nnx.initializers.ones, (c.iterations - 1,), (None,))
            if c.iteration_scales and c.iterations > 1 else None)
        self.experts = routed_experts(cfg, execution, layout, rngs=rngs)
        self.shared = shared_experts(cfg, execution, rngs=rngs)
        self.record_intermediates = False     # analysis switches it on (Module.set_attributes)

    def __call__(self, inputs: BlockInputs):
        x = inputs.x
        b, s, d = x.shape
        x0 = x.reshape(b * s, d)
        h, delta, stats, indices, routing = x0, jnp.zeros_like(x0), [], [], None
        counts = []                 # each router's own assignments (aux-free balancing)
        for t in range(self.iterations):
            router = self.routers[0 if self.shared_router else t]
            if t == 0 or not self.shared_router:
                routing = router(h)
            out, keep = self.experts(h, routing.indices)
            update = weighted_sum(routing.gates, out)
            if self.shared is not None:
                update = update + self.shared(h)
            if self.iteration_scales is not None and t > 0:
                update = update * self.iteration_scales[t - 1].astype(update.dtype)
            delta, h = coe_step(update.astype(x.dtype), delta, x0, self.residual)
            losses = router.losses(routing, sequences=b)
            if "expert_counts" in losses and (t == 0 or not self.shared_router):
                counts.append(losses["expert_counts"])
            stats.append(routed_stats(losses, keep, losses["expert_load"])._replace(
                router_counts=None))
            indices.append(routing.indices)
        y = coe_block_output(delta, x0, self.stream)
        mean_stats = jax.tree.map(lambda *v: jnp.mean(jnp.stack(v), axis=0), *stats)
        if counts:
            mean_stats = mean_stats._replace(router_counts=jnp.stack(counts))
        if self.record_intermediates:       # the expert ids of every iteration, [C, T, K]
            mean_stats = mean_stats._replace(record={"indices": jnp.stack(indices)})
        return y.reshape(b, s, d), mean_stats

    def balanced_routers(self) -> list:
        """The routers whose selection bias the training step moves, in the order of the
        stats' ``router_counts`` rows: one per iteration, or the one shared router."""
        return list(self.routers)


# The family's block (dagmoe_jax.config.families).
BLOCK = CoEBlock
