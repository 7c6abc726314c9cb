"""The DAG learning module's equations, DAG-MoE eq. 6-12, as pure functions of arrays.

Each function is one equation (or the closed form of one) and says which; the composed
iteration, which also decides how its LayerNorm, projections and pair sums run, is in
:mod:`dagmoe_jax.families.moe.dag.module`. Nodes are [T, K, d] in the router's rank order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EDGE_ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


def dag_initial_nodes(x: jax.Array, gates: jax.Array, expert_out: jax.Array):
    """DAG-MoE eq. 6: x_i^0 = g_i E_i(x) + x / K for the K selected experts in rank order.

    Returned as its two terms, (g_i E_i(x) [T, K, d], x / K [T, 1, d]), whose sum is x^0: the
    module carries the nodes' updates apart from the residual (see
    :class:`~dagmoe_jax.families.moe.dag.module.DAGAggregator`).
    """
    k = gates.shape[-1]
    updates = gates[..., None].astype(expert_out.dtype) * expert_out
    return updates, (x / k).astype(expert_out.dtype)[:, None, :]


def layer_norm_statistics(x32: jax.Array, eps: float,
                          one_pass: bool = False) -> tuple[jax.Array, jax.Array]:
    """DAG-MoE eq. 7's statistics of float32 ``x32`` over its last axis: (mean, 1 / sqrt(var +
    eps)), each keeping that axis as 1. ``one_pass``: var = E[x^2] - E[x]^2 (clamped at 0), as
    Flax's ``LayerNorm`` computes it by default (``use_fast_variance``): equal up to float32
    rounding, which grows with the mean's size against the spread, and both reductions read
    ``x32`` together, where the two-pass variance waits for the mean (a pass of its own on TPU,
    forward and backward)."""
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    if one_pass:
        var = jnp.maximum(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) - jnp.square(mean),
                          0.0)
    else:
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return mean, jax.lax.rsqrt(var + eps)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float,
               one_pass: bool = False) -> jax.Array:
    """DAG-MoE eq. 7: LayerNorm over the model dimension, statistics in float32 (``one_pass``:
    as :func:`layer_norm_statistics` has it)."""
    x32 = x.astype(jnp.float32)
    mean, rstd = layer_norm_statistics(x32, eps, one_pass)
    y = (x32 - mean) * rstd * scale + bias
    return y.astype(x.dtype)


def dag_pair_weights(w_edge: jax.Array, w_node: jax.Array) -> jax.Array:
    """DAG-MoE eq. 9 without the pair: W [u_i; u_j] = W_a u_i + W_b u_j with W_a, W_b the
    receiver and sender halves of W (W_edge and W_node [2 d_g, d_g]), so each node is
    projected once, by [W_edge,a | W_node,a | W_edge,b | W_node,b] [d_g, 4 d_g], into the
    [e_i | n_i | e_j | n_j] that :func:`dag_pair_messages` combines."""
    dg = w_edge.shape[-1]
    return jnp.concatenate([w_edge[:dg], w_node[:dg], w_edge[dg:], w_node[dg:]], axis=1)


def dag_pair_messages(proj: jax.Array, edge_act: str, edges: str = "all",
                      with_edges: bool = False):
    """DAG-MoE eq. 10 summed over j, from the projected nodes ``proj`` [T, K, 4 d_g] =
    [e_i | n_i | e_j | n_j] (:func:`dag_pair_weights`): sum_j act(e_i + e_j) * (n_i + n_j)
    [T, K, d_g], the K x K pairs as a broadcast add. ``edges='ranked'`` keeps only the pairs
    j <= i (node i hears the nodes ranked above it); ``with_edges`` also returns the edge
    gates e_(i,j) [T, K, K, d_g] (entry (t, i, j) gates the message node j sends to node i)."""
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
