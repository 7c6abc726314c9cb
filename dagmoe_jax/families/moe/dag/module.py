"""The DAG learning module (DAG-MoE eq. 6-12) as a Flax module: the iteration composed from the
equations (:mod:`dagmoe_jax.families.moe.dag.equations`), its parameters stacked over the L
iterations, and the scanned loop, run by the strategy of ``ExecutionConfig.dag_module``
(:mod:`dagmoe_jax.families.moe.dag.execution`).

Per-iteration parameters ``w_down [L, d, d_g]``, ``w_edge [L, 2 d_g, d_g]``,
``w_node [L, 2 d_g, d_g]``, ``w_up [L, d_g, d]`` and LayerNorm ``ln_scale, ln_bias [L, d]``
(one unstacked set with ``dag_shared_weights``); ``dag_edges='self'`` is the edge-free
ablation (each node's update from itself only).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.families.moe.config import AggregationConfig
from dagmoe_jax.families.moe.dag.equations import (dag_block_output, dag_initial_nodes,
                                                   dag_pair_messages, dag_pair_weights, dag_readout)
from dagmoe_jax.families.moe.dag.execution import XLA, XLAExecution, dag_execution
from dagmoe_jax.model.layers import make_param, normal
from dagmoe_jax.parallel import constrain


def dag_node_messages(nodes: jax.Array, ln_scale, ln_bias, w_down, w_edge, w_node,
                      edge_act: str, eps: float, edges: str = "all", with_edges: bool = False,
                      ex: XLAExecution = XLA):
    """DAG-MoE eq. 7-10 summed over j: sum_j m_(i,j) [T, K, d_g] for nodes x^{l-1} [T, K, d]
    (and the edge gates e_(i,j) [T, K, K, d_g], ``with_edges``, for which the pairs are always
    built by XLA), run by the strategy ``ex``. The pair [u_i; u_j] of eq. 9 is never built:
    each node is projected once by :func:`~dagmoe_jax.families.moe.dag.equations.dag_pair_weights`
    ([T*K, 4 d_g] in one matmul) and the K x K pairs are a broadcast add."""
    t, k, _ = nodes.shape
    u = ex.norm_project(nodes, ln_scale, ln_bias, w_down, eps)                    # eq. 7-8
    proj = ex.project(u.reshape(t, k, -1), dag_pair_weights(w_edge, w_node))      # eq. 9
    if with_edges:
        return dag_pair_messages(proj, edge_act, edges, with_edges=True)          # eq. 10
    return ex.pair_sum(proj, edges, edge_act)


def dag_node_update(nodes: jax.Array, ln_scale, ln_bias, w_down, w_edge, w_node, w_up,
                    edge_act: str, eps: float, edges: str = "all", with_edges: bool = False,
                    summed: bool = False, ex: XLAExecution = XLA):
    """DAG-MoE eq. 7-11 without eq. 11's residual term: W_up^l sum_j m_(i,j) for nodes
    x^{l-1} [T, K, d], so that x_i^l = x_i^{l-1} + this (and the edge gates, ``with_edges``).

    ``summed``: the updates summed over the nodes, as eq. 12 reads the last iteration out,
    sum_i W_up^L sum_j m_(i,j) [T, d]. W_up is linear, so it is applied once to the summed
    messages, W_up^L (sum_i sum_j m_(i,j)), instead of to each of the K nodes: that
    up-projection costs 1/K, forward and backward, and its [T, K, d] output is never built.
    """
    msg = dag_node_messages(nodes, ln_scale, ln_bias, w_down, w_edge, w_node, edge_act, eps,
                            edges, with_edges, ex)
    msg, edge = msg if with_edges else (msg, None)
    update = ex.project(jnp.sum(msg, axis=1) if summed else msg, w_up)          # eq. 11(-12)
    return (update, edge) if with_edges else update


def dag_summed_update(nodes: jax.Array, *weights, **options):
    """:func:`dag_node_update` with ``summed=True``: the last iteration's updates summed over
    the nodes [T, d], W_up applied once to the summed messages."""
    return dag_node_update(nodes, *weights, summed=True, **options)


def dag_iteration(nodes: jax.Array, ln_scale, ln_bias, w_down, w_edge, w_node, w_up,
                  edge_act: str, eps: float, edges: str = "all") -> jax.Array:
    """One DAG iteration l, DAG-MoE eq. 7-11: nodes x^{l-1} [T, K, d] -> x^l [T, K, d]."""
    return nodes + dag_node_update(nodes, ln_scale, ln_bias, w_down, w_edge, w_node, w_up,
                                   edge_act, eps, edges)


PARAM_NAMES = ("ln_scale", "ln_bias", "w_down", "w_edge", "w_node", "w_up")


class DAGIteration(nnx.Module):
    """The parameters of one DAG iteration; stacked L times by :class:`DAGAggregator`."""

    def __init__(self, d: int, dg: int, std: float, *, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        pd = param_dtype                      # the matrices; the LayerNorm stays float32
        self.ln_scale = make_param(rngs, nnx.initializers.ones, (d,), ("embed",))
        self.ln_bias = make_param(rngs, nnx.initializers.zeros, (d,), ("embed",))
        self.w_down = make_param(rngs, normal(std), (d, dg), ("embed", "dag"), pd)
        self.w_edge = make_param(rngs, normal(std), (2 * dg, dg), (None, "dag"), pd)
        self.w_node = make_param(rngs, normal(std), (2 * dg, dg), (None, "dag"), pd)
        self.w_up = make_param(rngs, nnx.initializers.zeros, (dg, d), ("dag", "embed"),
                               pd)                                             # zero init

    def weights(self) -> dict:
        """The parameters' values by name ([L, ...] when stacked)."""
        return {name: getattr(self, name)[...] for name in PARAM_NAMES}


class DAGAggregator(nnx.Module):
    """DAG-MoE eq. 6-12: initial nodes, L iterations, sum readout.

    ``iterations`` holds each iteration's weights stacked [L, ...], or with
    ``AggregationConfig.dag_shared_weights`` one unstacked set that every iteration applies.
    The L iterations are a scanned loop (``nnx.scan``, unrolled) over the iteration modules;
    a strategy that computes the L-th with the readout (XLA's, the CPU kernels') scans
    iterations 1 .. L-1 over the stacked weights and gives the L-th to
    :func:`dag_summed_update`, which needs only the nodes' sum: W_up once on the summed
    messages. A strategy whose kernels run
    whole iterations (the GPU's 'triton') runs eq. 6-12 itself (``aggregate``), its first
    kernel building the nodes and its last reading them out.

    The nodes are carried as x_i^l = r_i^l + x / K: the scan's carry is the updates r_i^l
    (r_i^0 = g_i E_i(x), eq. 6's expert term) and each iteration sees the whole node, so every
    equation runs on exactly the nodes the paper defines;
    :func:`~dagmoe_jax.families.moe.dag.equations.dag_block_output` then counts the residual once or
    twice (``AggregationConfig.dag_residual``).

    Built from its own ``AggregationConfig`` (kind 'dag'), the model width d, the
    initialisation's ``std``, the LayerNorm's ``eps`` (the model's ``norm_eps``) and the
    parameters' dtype. ``execution.dag_module`` (a settled
    :class:`~dagmoe_jax.config.ExecutionConfig`; None: 'xla') picks the strategy once
    (:func:`~dagmoe_jax.families.moe.dag.execution.dag_execution`).
    """

    def __init__(self, cfg: AggregationConfig, d_model: int, *, std: float, eps: float,
                 param_dtype=jnp.float32, execution: Optional[ExecutionConfig] = None,
                 rngs: nnx.Rngs):
        self.reading, self.edge_act, self.edges = cfg.dag_residual, cfg.edge_act, cfg.dag_edges
        self.eps = eps
        self.ex = dag_execution(execution.dag_module) if execution is not None else XLA
        self.record_intermediates = False     # analysis switches it on (Module.set_attributes)
        self.num_iters, self.shared = cfg.dag_iters, cfg.dag_shared_weights
        if self.shared:                       # one module for all L iterations (unstacked)
            self.iterations = DAGIteration(d_model, cfg.dag_dim, std, param_dtype=param_dtype,
                                           rngs=rngs)
            return

        @nnx.split_rngs(splits=cfg.dag_iters)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "dag_iters"})
        def make(r):
            return DAGIteration(d_model, cfg.dag_dim, std, param_dtype=param_dtype, rngs=r)

        self.iterations = make(rngs)

    def __call__(self, x, gates, expert_out):
        # the compiled program's instructions carry the module's name (compile/roofline.py
        # attributes the DAG module's kernels by it)
        with jax.named_scope("dag_module"):
            return self._aggregate(x, gates, expert_out)

    def _aggregate(self, x, gates, expert_out):
        record = self.record_intermediates
        if self.ex.whole_module and not record:      # the kernels run eq. 6-12
            summed = self.ex.aggregate(x, gates, expert_out, self.iterations.weights(),
                                       self.num_iters, self.shared, self.edges,
                                       self.edge_act, self.eps)
            return dag_block_output(summed, x.astype(expert_out.dtype), self.reading), {}
        updates, residual = dag_initial_nodes(x, gates, expert_out)              # eq. 6
        options = dict(edge_act=self.edge_act, eps=self.eps, edges=self.edges,
                       with_edges=record, ex=self.ex)

        def step(updates, w):                                                    # eq. 7-11
            nodes = updates + residual
            out = dag_node_update(nodes, **w, **options)
            update, edge = out if record else (out, None)
            update = constrain(update, ("batch", "nodes", "embed"))
            return updates + update, ({"edge_gates": edge, "dag_inputs": nodes} if record
                                      else {})

        if not self.ex.last_with_readout:     # all L iterations scanned over the modules
            body = lambda updates, iteration: step(updates, iteration.weights())  # noqa: E731
            scan = (nnx.scan(body, in_axes=(nnx.Carry, None), out_axes=(nnx.Carry, 0),
                             length=self.num_iters, unroll=True) if self.shared else
                    nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                             unroll=True, transform_metadata={nnx.PARTITION_NAME: "dag_iters"}))
            updates, kept = scan(updates, self.iterations)
            return dag_block_output(dag_readout(updates), x.astype(expert_out.dtype),
                                    self.reading), kept

        weights = self.iterations.weights()
        head = {n: w[:-1] for n, w in weights.items()} if not self.shared else None
        last = {n: w[-1] for n, w in weights.items()} if not self.shared else weights
        updates, kept = jax.lax.scan(lambda u, w: step(u, weights if self.shared else w),
                                     updates, head, length=self.num_iters - 1, unroll=True)
        nodes = updates + residual                                                # x^{L-1}
        out = dag_summed_update(nodes, **last, **options)                        # eq. 7-12
        update, edge = out if record else (out, None)
        summed = dag_readout(updates) + constrain(update, ("batch", "embed"))
        if record:
            kept = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), kept,
                                {"edge_gates": edge, "dag_inputs": nodes})
        return dag_block_output(summed, x.astype(expert_out.dtype), self.reading), kept
