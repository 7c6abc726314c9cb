"""Aggregators: how the K selected expert outputs become the block output (docs/design.md section 4).

* ``sum``: the standard weighted sum (DAG-MoE eq. 1).
* ``dag``: the DAG learning module (DAG-MoE eq. 6-12), L iterations scanned over stacked
  per-iteration parameters (with the CPU kernels the last is computed with the readout)
  ``w_down [L, d, d_g]``, ``w_edge [L, 2 d_g, d_g]``,
  ``w_node [L, 2 d_g, d_g]``, ``w_up [L, d_g, d]`` and LayerNorm ``ln_scale, ln_bias [L, d]``
  (one unstacked set with ``dag_shared_weights``); ``dag_edges='self'`` is the edge-free
  ablation (each node's update from itself only).
* ``mlp``: the structureless MLP-mixing ablation (DAG-MoE summary ablation table; our reading).

Every aggregator is called as ``agg(x, gates, expert_out)`` with x [T, d], gates [T, K] and
expert_out [T, K, d] in the router's rank order, and returns (y [T, d], record): ``record`` is
empty unless the DAG module's ``record_intermediates`` flag is on (for analysis), when it holds
each iteration's edge gates e_(i,j) [L, T, K, K, d_g] and input nodes [L, T, K, d].
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.kernels.dag_module import fused_dag_messages, fused_layer_norm
from dagmoe_jax.kernels.grouped_matmul import cpu_dense_matmul
from dagmoe_jax.model.layers import dtype_of, make_param, normal
from dagmoe_jax.parallel import constrain

EDGE_ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


def weighted_sum(gates: jax.Array, expert_out: jax.Array) -> jax.Array:
    """DAG-MoE eq. 1: y = sum_k g_k E_k(x)."""
    return jnp.einsum("tk,tkd->td", gates.astype(expert_out.dtype), expert_out)


def dag_initial_nodes(x: jax.Array, gates: jax.Array, expert_out: jax.Array):
    """DAG-MoE eq. 6: x_i^0 = g_i E_i(x) + x / K for the K selected experts in rank order.

    Returned as its two terms, (g_i E_i(x) [T, K, d], x / K [T, 1, d]), whose sum is x^0: the
    module carries the nodes' updates apart from the residual (see :class:`DAGAggregator`).
    """
    k = gates.shape[-1]
    updates = gates[..., None].astype(expert_out.dtype) * expert_out
    return updates, (x / k).astype(expert_out.dtype)[:, None, :]


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """DAG-MoE eq. 7: LayerNorm over the model dimension, statistics in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias
    return y.astype(x.dtype)


def project(x: jax.Array, w: jax.Array, fused: bool = False, flat: bool = True) -> jax.Array:
    """``x [..., a] @ w [a, b]`` in ``x``'s dtype, the DAG module's projections (eq. 8, 9, 11).

    ``flat``: on the rows of ``x`` as one [N, a] matrix (``ExecutionConfig.dag_module`` 'xla'
    and 'fused'). On CPU and GPU that reshape is free, and with the node axis kept XLA:CPU runs
    the weight gradient, a contraction over two axes, 1.45x slower (the XLA module, measured).
    ``fused`` (the CPU kernels' path) also runs the weight gradient in the C++ kernel
    (:func:`cpu_dense_matmul`), about twice XLA:CPU's speed at the module's shapes.
    ``flat=False`` ('xla_rank3', TPU's): an einsum on ``x`` as it is, for on TPU the
    [T, K, d] -> [T*K, d] reshape is a copy between tiled layouts (K = 4 rows fill half of an
    8-row tile), which the compiled DAG-MoE-l step paid at every projection.
    """
    w = w.astype(x.dtype)
    if not (flat or fused):
        return jnp.einsum("...a,ab->...b", x, w)
    rows = x.reshape(-1, x.shape[-1])
    out = cpu_dense_matmul(rows, w) if fused else rows @ w
    return out.reshape(*x.shape[:-1], w.shape[-1])


def dag_messages(u: jax.Array, w_edge: jax.Array, w_node: jax.Array, edge_act: str,
                 edges: str = "all", with_edges: bool = False, fused: bool = False,
                 flat: bool = True):
    """DAG-MoE eq. 9-10 summed over j as eq. 11 needs: sum_j e_(i,j) * W_node [u_i; u_j].

    ``u`` [T, K, d_g] are the down-projected nodes (eq. 8). The pair [u_i; u_j] of eq. 9 is never
    built: W [u_i; u_j] = W_a u_i + W_b u_j with W_a, W_b the two halves of W, so each node is
    projected once ([T*K, 4 d_g] in one matmul) and the K x K pairs are a broadcast add.
    ``edges='ranked'`` keeps only the pairs j <= i (node i hears the nodes ranked above it).
    ``with_edges`` also returns the edge gates e_(i,j) [T, K, K, d_g] (entry (t, i, j) gates the
    message node j sends to node i). ``fused`` (``ExecutionConfig.dag_module='fused'``) sums
    the pairs in the C++ kernel of :mod:`dagmoe_jax.kernels.dag_module`, which never builds
    the [T, K, K, d_g] pair tensor; with ``with_edges`` the pairs are always built here.
    ``flat``: see :func:`project`.
    """
    dg = u.shape[-1]
    w_pair = jnp.concatenate([w_edge[:dg], w_node[:dg], w_edge[dg:], w_node[dg:]], axis=1)
    proj = project(u, w_pair, fused, flat)                                     # [T, K, 4 d_g]
    if fused and not with_edges:
        return fused_dag_messages(proj, edges, edge_act)
    return dag_pair_messages(proj, edge_act, edges, with_edges)


def dag_pair_messages(proj: jax.Array, edge_act: str, edges: str = "all",
                      with_edges: bool = False):
    """DAG-MoE eq. 10 summed over j, from the projected nodes ``proj`` [T, K, 4 d_g] =
    [e_i | n_i | e_j | n_j] (u_i times W_edge's and W_node's receiver and sender halves):
    sum_j act(e_i + e_j) * (n_i + n_j) [T, K, d_g], the K x K pairs as a broadcast add
    (and the edge gates [T, K, K, d_g], ``with_edges``); :func:`dag_messages` says the rest."""
    k = proj.shape[1]
    e_i, n_i, e_j, n_j = jnp.split(proj, 4, axis=-1)
    if edges == "self":
        return dag_self_messages(e_i, n_i, e_j, n_j, edge_act, with_edges)
    edge = EDGE_ACTIVATIONS[edge_act](e_i[:, :, None, :] + e_j[:, None, :, :])   # e_(i,j) [T,K,K,dg]
    if edges == "ranked":
        edge = edge * jnp.tril(jnp.ones((k, k), edge.dtype))[None, :, :, None]
    msg = jnp.sum(edge * (n_i[:, :, None, :] + n_j[:, None, :, :]), axis=2)
    return (msg, edge) if with_edges else msg


def dag_self_messages(e_i, n_i, e_j, n_j, edge_act: str, with_edges: bool = False):
    """The edge-free ablation (``dag_edges='self'``, ours): eq. 10 on the self pair only,
    m_i = sigma(W_edge [u_i; u_i]) * W_node [u_i; u_i], so node i's update (eq. 11) uses no
    other node. ``e_i, e_j, n_i, n_j`` [T, K, d_g]: u_i times the halves of W_edge and W_node.
    The recorded edge gates are [T, K, K, d_g], zero off the diagonal."""
    edge = EDGE_ACTIVATIONS[edge_act](e_i + e_j)                                 # e_(i,i)
    msg = edge * (n_i + n_j)
    if not with_edges:
        return msg
    eye = jnp.eye(edge.shape[1], dtype=edge.dtype)[None, :, :, None]
    return msg, edge[:, :, None, :] * eye


def edge_mask(k: int, edges: str) -> np.ndarray:
    """[K, K] booleans: the node pairs (receiver i, sender j) the graph of ``dag_edges`` has."""
    if edges == "ranked":
        return np.tril(np.ones((k, k), bool))
    return np.eye(k, dtype=bool) if edges == "self" else np.ones((k, k), bool)


def dag_node_messages(nodes: jax.Array, ln_scale, ln_bias, w_down, w_edge, w_node,
                      edge_act: str, eps: float, edges: str = "all", with_edges: bool = False,
                      fused: bool = False, flat: bool = True):
    """DAG-MoE eq. 7-10 summed over j: sum_j m_(i,j) [T, K, d_g] for nodes x^{l-1} [T, K, d]
    (and the edge gates, ``with_edges``). ``fused`` (``ExecutionConfig.dag_module='fused'``)
    runs eq. 7's LayerNorm and eq. 10's pairs in the C++ kernels of
    :mod:`dagmoe_jax.kernels.dag_module` (see :func:`dag_messages`), and the projections'
    weight gradients in another (see :func:`project`, which says what ``flat`` does).
    """
    t, k, d = nodes.shape
    norm = fused_layer_norm if fused else layer_norm
    # the LayerNorm on the rows its projection takes (project's condition), so that 'xla' and
    # 'fused' keep the programs they had before 'xla_rank3' existed
    rows = nodes.reshape(t * k, d) if flat or fused else nodes
    u = project(norm(rows, ln_scale, ln_bias, eps), w_down, fused, flat)           # eq. 7-8
    u = u.reshape(t, k, -1)
    return dag_messages(u, w_edge, w_node, edge_act, edges, with_edges, fused,
                        flat)                                                      # eq. 9-10


def dag_node_update(nodes: jax.Array, ln_scale, ln_bias, w_down, w_edge, w_node, w_up,
                    edge_act: str, eps: float, edges: str = "all", with_edges: bool = False,
                    fused: bool = False, summed: bool = False, flat: bool = True):
    """DAG-MoE eq. 7-11 without eq. 11's residual term: W_up^l sum_j m_(i,j) for nodes
    x^{l-1} [T, K, d], so that x_i^l = x_i^{l-1} + this (and the edge gates, ``with_edges``).

    ``summed``: the updates summed over the nodes, as eq. 12 reads the last iteration out,
    sum_i W_up^L sum_j m_(i,j) [T, d]. W_up is linear, so it is applied once to the summed
    messages, W_up^L (sum_i sum_j m_(i,j)), instead of to each of the K nodes: that
    up-projection costs 1/K, forward and backward, and its [T, K, d] output is never built.
    """
    msg = dag_node_messages(nodes, ln_scale, ln_bias, w_down, w_edge, w_node, edge_act, eps,
                            edges, with_edges, fused, flat)
    msg, edge = msg if with_edges else (msg, None)
    update = project(jnp.sum(msg, axis=1) if summed else msg, w_up, fused, flat)    # eq. 11(-12)
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


def dag_readout(nodes: jax.Array) -> jax.Array:
    """DAG-MoE eq. 12: y = sum_i x_i^L."""
    return jnp.sum(nodes, axis=1)


def dag_block_output(summed_updates: jax.Array, x: jax.Array, reading: str) -> jax.Array:
    """The DAG block's output from the nodes' summed updates sum_i r_i^L [T, d], where
    r_i^L = x_i^L - x / K.

    Eq. 12's y = sum_i x_i^L equals sum_i r_i^L + x. ``reading='literal'`` returns that;
    'once' (``AggregationConfig.dag_residual``) returns sum_i r_i^L = y - x, because the
    decoder adds its own residual h around the block and x = RMSNorm(h) would otherwise be
    added to the stream a second time. Computed from the updates, not as y - x, so that with
    W_up = 0 it is the weighted sum of eq. 1 with no cancellation error in any dtype.
    """
    return summed_updates + x if reading == "literal" else summed_updates


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
    The L iterations are a scanned loop (``nnx.scan``, unrolled) over the iteration modules.
    With the CPU kernels (``fused``) iterations 1 .. L-1 are scanned over the stacked weights
    and the L-th is computed together with the readout (:func:`dag_summed_update`), which needs
    only the nodes' sum: W_up once on the summed messages. (On TPU that split of the loop
    cost 0.6 GB more temporaries a chip for DAG-MoE-l, benchmarks/RESULTS.md, so the XLA path
    keeps the one scan.)

    The nodes are carried as x_i^l = r_i^l + x / K: the scan's carry is the updates r_i^l
    (r_i^0 = g_i E_i(x), eq. 6's expert term) and each iteration sees the whole node, so every
    equation runs on exactly the nodes the paper defines; :func:`dag_block_output` then counts
    the residual once or twice (``AggregationConfig.dag_residual``).

    ``execution.dag_module`` (a settled :class:`~dagmoe_jax.config.ExecutionConfig`; None:
    'xla') says how the LayerNorm, the pairwise messages and the projections run: 'fused' by
    the C++ kernels, 'xla' and 'xla_rank3' by XLA (see :func:`project`).
    """

    def __init__(self, cfg: ModelConfig, execution: Optional[ExecutionConfig] = None, *,
                 rngs: nnx.Rngs):
        agg = cfg.block.aggregation
        self.reading, self.edge_act, self.edges = agg.dag_residual, agg.edge_act, agg.dag_edges
        self.eps = cfg.norm_eps
        self.fused = execution is not None and execution.dag_module == "fused"
        self.flat = execution is None or execution.dag_module != "xla_rank3"
        self.record_intermediates = False     # analysis switches it on (Module.set_attributes)
        self.num_iters, self.shared = agg.dag_iters, agg.dag_shared_weights
        if self.shared:                       # one module for all L iterations (unstacked)
            self.iterations = DAGIteration(cfg.d_model, agg.dag_dim, cfg.init_std,
                                           param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)
            return

        @nnx.split_rngs(splits=agg.dag_iters)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "dag_iters"})
        def make(r):
            return DAGIteration(cfg.d_model, agg.dag_dim, cfg.init_std,
                                param_dtype=dtype_of(cfg.param_dtype), rngs=r)

        self.iterations = make(rngs)

    def __call__(self, x, gates, expert_out):
        # the compiled program's instructions carry the module's name (compile/roofline.py
        # attributes the DAG module's kernels by it)
        with jax.named_scope("dag_module"):
            return self._aggregate(x, gates, expert_out)

    def _aggregate(self, x, gates, expert_out):
        updates, residual = dag_initial_nodes(x, gates, expert_out)              # eq. 6
        record = self.record_intermediates
        options = dict(edge_act=self.edge_act, eps=self.eps, edges=self.edges,
                       with_edges=record, fused=self.fused, flat=self.flat)

        def step(updates, w):                                                    # eq. 7-11
            nodes = updates + residual
            out = dag_node_update(nodes, **w, **options)
            update, edge = out if record else (out, None)
            update = constrain(update, ("batch", "nodes", "embed"))
            return updates + update, ({"edge_gates": edge, "dag_inputs": nodes} if record
                                      else {})

        if not self.fused:        # all L iterations scanned over the iteration modules
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


def mlp_mix(s: jax.Array, w_1: jax.Array, w_2: jax.Array, w_3: jax.Array, eps: float) -> jax.Array:
    """MLP mixing (our reading): y = s + W_3 (silu(W_1 LN(s)) * W_2 LN(s)), s = sum_k g_k E_k.

    The LayerNorm has no affine parameters, so the mixer has exactly 3 d d_g parameters (98,304
    at d 512, d_g 64, the ablation's "98K").
    """
    d = s.shape[-1]
    h = layer_norm(s, jnp.ones((d,), jnp.float32), jnp.zeros((d,), jnp.float32), eps)
    dt = s.dtype
    return s + (jax.nn.silu(h @ w_1.astype(dt)) * (h @ w_2.astype(dt))) @ w_3.astype(dt)


class MLPMixer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, dg = cfg.d_model, cfg.block.aggregation.dag_dim
        self.eps = cfg.norm_eps
        pd = dtype_of(cfg.param_dtype)
        self.w_1 = make_param(rngs, normal(cfg.init_std), (d, dg), ("embed", "dag"), pd)
        self.w_2 = make_param(rngs, normal(cfg.init_std), (d, dg), ("embed", "dag"), pd)
        self.w_3 = make_param(rngs, nnx.initializers.zeros, (dg, d), ("dag", "embed"), pd)

    def __call__(self, x, gates, expert_out):
        return mlp_mix(weighted_sum(gates, expert_out), self.w_1[...], self.w_2[...], self.w_3[...],
                       self.eps), {}


class SumAggregator(nnx.Module):
    def __call__(self, x, gates, expert_out):
        return weighted_sum(gates, expert_out), {}


def make_aggregator(cfg: ModelConfig, execution: Optional[ExecutionConfig] = None, *,
                    rngs: nnx.Rngs) -> nnx.Module:
    kind = cfg.block.aggregation.kind
    if kind == "dag":
        return DAGAggregator(cfg, execution, rngs=rngs)
    if kind == "mlp":
        return MLPMixer(cfg, rngs=rngs)
    return SumAggregator()
