"""The MoE block: router -> experts -> aggregator (sum, DAG or MLP) + shared experts, under the
block protocol (:mod:`dagmoe_jax.model.block`)."""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.families.moe.aggregation import make_aggregator
from dagmoe_jax.families.moe.dag.bottleneck import SAVED_NAMES
from dagmoe_jax.model.block import BlockInputs, BlockStats, routed_stats
from dagmoe_jax.model.routed.experts import Experts
from dagmoe_jax.model.layers import SwiGLU, dtype_of
from dagmoe_jax.model.routed.router import Router
from dagmoe_jax.parallel.axes import MeshLayout


def shared_experts(cfg: ModelConfig, execution: ExecutionConfig, *,
                   rngs: nnx.Rngs) -> Optional[SwiGLU]:
    """``ExpertConfig.num_shared`` shared experts as one SwiGLU (None without any)."""
    e = cfg.block.experts
    if e.num_shared == 0:
        return None
    return SwiGLU(cfg.d_model, e.num_shared * e.shared_hidden, cfg.init_std,
                  dtype_of(cfg.compute_dtype), fuse_projections=execution.fuse_projections,
                  param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)


def routed_experts(cfg: ModelConfig, execution: ExecutionConfig, layout: Optional[MeshLayout],
                   *, rngs: nnx.Rngs) -> Experts:
    """The routed experts of ``cfg``, run as ``execution`` (settled), dispatched across
    ``layout``."""
    return Experts(cfg.block.experts, cfg.d_model, std=cfg.init_std,
                   dtype=dtype_of(cfg.compute_dtype), execution=execution, layout=layout,
                   param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)


class MoEBlock(nnx.Module):
    """y = Aggregate(x, g, E(x)) + sum of shared experts(x), for x [B, S, d]; the router sees
    the B * S tokens flattened, and the B rows as the sequences of its losses.

    With ``record_intermediates`` on, the stats' record holds the routed expert ids
    ``indices`` [1, T, K] (rank order) and the aggregator's own record (the DAG's edge gates).
    """

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig,
                 layout: Optional[MeshLayout] = None, *, rngs: nnx.Rngs):
        self.router = Router(cfg.block.router, cfg.d_model, cfg.block.experts.num_experts,
                             std=cfg.init_std, rngs=rngs)
        self.experts = routed_experts(cfg, execution, layout, rngs=rngs)
        self.aggregator = make_aggregator(cfg.block.aggregation, cfg.d_model, std=cfg.init_std,
                                          eps=cfg.norm_eps,
                                          param_dtype=dtype_of(cfg.param_dtype),
                                          execution=execution, rngs=rngs)
        self.shared = shared_experts(cfg, execution, rngs=rngs)
        self.record_intermediates = False     # analysis switches it on (Module.set_attributes)

    def __call__(self, inputs: BlockInputs) -> tuple[jax.Array, BlockStats]:
        x = inputs.x
        b, s, d = x.shape
        xt = x.reshape(b * s, d)
        routing = self.router(xt)
        expert_out, keep = self.experts(xt, routing.indices)
        y, kept = self.aggregator(xt, routing.gates, expert_out)
        if self.shared is not None:
            y = y + self.shared(xt)
        losses = self.router.losses(routing, sequences=b)
        record = ({"indices": routing.indices[None], **kept} if self.record_intermediates
                  else None)
        return (y.reshape(b, s, d).astype(x.dtype),
                routed_stats(losses, keep, losses["expert_load"], record))

    def balanced_routers(self) -> list:
        """The routers whose selection bias the training step moves, in the order of the
        stats' ``router_counts`` rows: the one router."""
        return [self.router]


# The family's block (dagmoe_jax.config.families).
BLOCK = MoEBlock
