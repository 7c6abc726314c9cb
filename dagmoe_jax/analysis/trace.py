"""Recompute a trained model's forward pass layer by layer, keeping what the plots need.

The model scans one compiled layer body over parameters stacked on a leading ``layers`` axis,
so nothing inside a layer is visible from outside. :func:`trace_tokens` runs the same
computation one layer at a time in Python: it slices layer i's parameters off the stacked
axis (:func:`layer_module`), calls the layer's own attention, norms, router and experts, and
for the DAG module re-runs the pure functions of :mod:`dagmoe_jax.model.aggregation`
(eq. 6-12) iteration by iteration, keeping the edge gates e_(i,j) of eq. 10 that the model
computes and discards. The model's modules are not changed; the tests check that the traced
logits equal the model's own.

Per layer the trace keeps the router's expert ids (rank order; for CoE, one set per iteration),
and for a DAG layer the edge gates of every iteration, [T, K, K, d_g]: entry (t, i, j) is the
gate of the message node j sends to node i (eq. 10's ``e_(i,j) = sigma(W_edge [u_i; u_j])``),
nodes in the router's rank order. :func:`collect` runs the trace over batches and reduces it to
NumPy statistics over the non-padding tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.model.aggregation import (EDGE_ACTIVATIONS, dag_block_output, dag_initial_nodes,
                                          dag_node_update, layer_norm, weighted_sum)
from dagmoe_jax.model.attention import rope_angles
from dagmoe_jax.model.coe import coe_block_output, coe_step
from dagmoe_jax.model.layers import dtype_of

DAG_PARAMS = ("ln_scale", "ln_bias", "w_down", "w_edge", "w_node", "w_up")


def layer_module(model, index: int):
    """Layer ``index`` of ``model`` as a stand-alone ``DecoderLayer`` (its parameters sliced
    off the scanned ``layers`` axis; the model itself is untouched)."""
    graphdef, state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[index], state))


def edge_gates(u: jax.Array, w_edge: jax.Array, edge_act: str, edges: str = "all") -> jax.Array:
    """DAG-MoE eq. 9-10's edge gates ``e_(i,j) = sigma(W_edge [u_i; u_j])`` for all pairs.

    ``u`` [T, K, d_g] are the down-projected nodes (eq. 8), ``w_edge`` [2 d_g, d_g]. Returns
    [T, K, K, d_g]; entry (t, i, j) gates the message from node j to node i. As in the model,
    ``W_edge [u_i; u_j] = W_a u_i + W_b u_j`` (W_a, W_b the halves of W_edge). With
    ``edges='ranked'`` the pairs j > i, which the model masks out, are 0.
    """
    dg = u.shape[-1]
    e_i = u @ w_edge[:dg].astype(u.dtype)
    e_j = u @ w_edge[dg:].astype(u.dtype)
    gates = EDGE_ACTIVATIONS[edge_act](e_i[:, :, None, :] + e_j[:, None, :, :])
    if edges == "ranked":
        k = u.shape[1]
        gates = gates * jnp.tril(jnp.ones((k, k), gates.dtype))[None, :, :, None]
    return gates


def _dag_trace(aggregator, cfg, x, gates, expert_out):
    """The DAG module (eq. 6-12) one iteration at a time: output y and each iteration's edge
    gates and input nodes."""
    agg = cfg.aggregation
    stacked = {name: getattr(aggregator.iterations, name)[...] for name in DAG_PARAMS}
    updates, residual = dag_initial_nodes(x, gates, expert_out)                  # eq. 6
    edge, inputs = [], []
    for it in range(agg.dag_iters):
        p = {name: value[it] for name, value in stacked.items()}
        nodes = updates + residual
        t, k, d = nodes.shape
        u = layer_norm(nodes.reshape(t * k, d), p["ln_scale"], p["ln_bias"], cfg.norm_eps)
        u = (u @ p["w_down"].astype(nodes.dtype)).reshape(t, k, -1)                # eq. 7-8
        edge.append(edge_gates(u, p["w_edge"], agg.edge_act, agg.dag_edges))      # eq. 9-10
        inputs.append(nodes)
        updates = updates + dag_node_update(nodes, p["ln_scale"], p["ln_bias"], p["w_down"],
                                            p["w_edge"], p["w_node"], p["w_up"], agg.edge_act,
                                            cfg.norm_eps, agg.dag_edges)         # eq. 7-11
    y = dag_block_output(updates, x.astype(expert_out.dtype), agg.dag_residual)  # eq. 12
    return y, jnp.stack(edge), jnp.stack(inputs)


def _moe_trace(block, cfg, x):
    routing = block.router(x)
    expert_out, _ = block.experts(x, routing.indices)
    record = {"indices": routing.indices[None]}                                  # [1, T, K]
    if cfg.aggregation.kind == "dag":
        y, record["edge_gates"], record["dag_inputs"] = _dag_trace(
            block.aggregator, cfg, x, routing.gates, expert_out)
    else:
        y = block.aggregator(x, routing.gates, expert_out)
    if block.shared is not None:
        y = y + block.shared(x)
    return y, record


def _coe_trace(block, cfg, x0):
    c = cfg.coe
    h, delta, indices, routing = x0, jnp.zeros_like(x0), [], None
    for t in range(c.iterations):
        if t == 0 or not c.shared_router:
            routing = block.routers[t](h)
        out, _ = block.experts(h, routing.indices)
        update = weighted_sum(routing.gates, out)
        if block.shared is not None:
            update = update + block.shared(h)
        delta, h = coe_step(update.astype(x0.dtype), delta, x0, c.residual)
        indices.append(routing.indices)
    y = coe_block_output(delta, x0, c.stream)
    return y, {"indices": jnp.stack(indices)}                                     # [C, T, K]


@nnx.jit
def _layer_step(layer, h, sin, cos):
    """One decoder layer (as ``DecoderLayer.__call__``) and its trace record."""
    cfg = layer.cfg
    h = h + layer.attn(layer.attn_norm(h), sin, cos)
    x = layer.block_norm(h)
    b, s, d = x.shape
    xt = x.reshape(b * s, d)
    if cfg.block == "moe":
        y, record = _moe_trace(layer.block, cfg, xt)
    elif cfg.block == "coe":
        y, record = _coe_trace(layer.block, cfg, xt)
    else:
        y, record = layer.block(x).reshape(b * s, d), {}
    return layer.add_block_output(h, y.reshape(b, s, d)), record


def trace_tokens(model, tokens) -> Dict[str, object]:
    """Logits [B, S, V] (float32) and one trace record per layer for ``tokens`` [B, S].

    Each record: ``indices`` [C, T, K] (expert ids in rank order; C = 1 except for CoE, one
    row per iteration), and for a DAG layer ``edge_gates`` [L, T, K, K, d_g] and
    ``dag_inputs`` [L, T, K, d] (the nodes each iteration starts from). T = B * S, row-major.
    Tokens are traced in one call per layer, as in the model's forward pass, so capacity
    dispatch drops the same assignments.
    """
    cfg = model.cfg
    tokens = jnp.asarray(tokens, jnp.int32)
    sin, cos = rope_angles(jnp.arange(tokens.shape[1])[None, :], cfg.resolved_head_dim,
                           cfg.rope_theta)
    h = model.embed[...].astype(dtype_of(cfg.compute_dtype))[tokens]
    records = []
    for i in range(cfg.num_layers):
        h, record = _layer_step(layer_module(model, i), h, sin, cos)
        records.append(record)
    h = model.final_norm(h)
    b, s, d = h.shape
    logits = jnp.dot(h.reshape(b * s, d), model.lm_head[...].astype(h.dtype),
                     preferred_element_type=jnp.float32).reshape(b, s, -1)
    return {"logits": logits, "layers": records}


@dataclasses.dataclass
class Collected:
    """Statistics of a model's routing and DAG gates over the non-padding tokens of a dataset.

    tokens: tokens traced. block, aggregation: the model's block type and aggregator kind.
    expert_load [layers, N]: share of routing slots per expert (all iterations, for CoE).
    coactivation [layers, C - 1, N, N] or None: CoE only; entry (l, t, a, b) counts tokens that
    used expert a in iteration t and expert b in iteration t + 1 (CoE Figure 8).
    gate_mean, gate_std [layers, L, K, K] or None: DAG only; per token the gate magnitude of a
    node pair is the mean over d_g of |e_(i,j)|; these are its mean and standard deviation over
    tokens (row i: receiving node, column j: sending node, rank order).
    gate_samples [layers, L, M, K, K] or None: the per-token magnitudes of up to M tokens (for
    histograms).
    """

    tokens: int
    block: str
    aggregation: str
    expert_load: Optional[np.ndarray]
    coactivation: Optional[np.ndarray]
    gate_mean: Optional[np.ndarray]
    gate_std: Optional[np.ndarray]
    gate_samples: Optional[np.ndarray]


def collect(model, batches: Iterable[Dict[str, np.ndarray]], max_samples: int = 4096) -> Collected:
    """Trace ``model`` over ``batches`` (dicts with ``inputs`` and ``mask`` [B, S]) and reduce.

    Padding positions (``mask`` False) are left out of every statistic.
    """
    cfg = model.cfg
    n = cfg.experts.num_experts
    routed = cfg.block in ("moe", "coe")
    layers = cfg.num_layers
    load = np.zeros((layers, n)) if routed else None
    coact = None
    if cfg.block == "coe" and cfg.coe.iterations > 1:
        coact = np.zeros((layers, cfg.coe.iterations - 1, n, n))
    is_dag = cfg.block == "moe" and cfg.aggregation.kind == "dag"
    g_sum = g_sq = None
    samples: List[np.ndarray] = []
    count = 0
    for batch in batches:
        keep = np.asarray(batch["mask"], bool).reshape(-1)
        if not keep.any():
            continue
        trace = trace_tokens(model, batch["inputs"])
        count += int(keep.sum())
        magnitudes = []
        for l, record in enumerate(trace["layers"]):
            if not routed:
                break
            ids = np.asarray(record["indices"])[:, keep]                     # [C, T', K]
            load[l] += np.bincount(ids.reshape(-1), minlength=n)
            if coact is not None:
                onehot = (ids[..., None] == np.arange(n)).any(axis=2).astype(np.float64)
                for t in range(ids.shape[0] - 1):
                    coact[l, t] += onehot[t].T @ onehot[t + 1]
            if is_dag:
                gates = np.asarray(record["edge_gates"])[:, keep]             # [L, T', K, K, dg]
                magnitudes.append(np.abs(gates).mean(axis=-1))                # [L, T', K, K]
        if is_dag:
            mag = np.stack(magnitudes)                                        # [layers, L, T', K, K]
            g_sum = mag.sum(axis=2) if g_sum is None else g_sum + mag.sum(axis=2)
            g_sq = (mag ** 2).sum(axis=2) if g_sq is None else g_sq + (mag ** 2).sum(axis=2)
            if sum(s.shape[2] for s in samples) < max_samples:
                samples.append(mag)
    if count == 0:
        raise ValueError("the data has no (non-padding) tokens to trace")
    if load is not None:
        load = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
    gate_mean = gate_std = gate_samples = None
    if is_dag:
        gate_mean = g_sum / count
        gate_std = np.sqrt(np.maximum(g_sq / count - gate_mean ** 2, 0.0))
        gate_samples = np.concatenate(samples, axis=2)[:, :, :max_samples]
    return Collected(tokens=count, block=cfg.block, aggregation=cfg.aggregation.kind,
                     expert_load=load, coactivation=coact, gate_mean=gate_mean,
                     gate_std=gate_std, gate_samples=gate_samples)
