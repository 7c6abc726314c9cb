"""What the model records while it runs, over a dataset, reduced to the plots' statistics.

The routed blocks record their intermediates themselves when their ``record_intermediates``
flag is on (``dagmoe_jax.model.transformer`` documents ``aux['intermediates']``): the expert ids
of every routing decision (rank order; one set per CoE iteration) and, for the DAG module, the
edge gates e_(i,j) of DAG-MoE eq. 10 and each iteration's input nodes. :func:`record` switches
the flag on for one forward pass of the model's own code (so the numbers are the model's, with
the same dispatch and the same drops) and :func:`collect` reduces them over batches to NumPy
statistics over the non-padding tokens. Nothing here re-implements a forward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.config import aggregation_of, dag_aggregation_of, experts_of, routing_steps


SPARSITY_THRESHOLD = 0.1     # |e_(i,j)| below this counts as a switched-off edge (gate ~ 0)


def gate_sparsity_counts(gates: np.ndarray, mask: np.ndarray, threshold: float):
    """Edge gates [layers, L, T, K, K, d_g] -> (values below, pairs below) [layers, L] counts
    and (values, pairs) totals per [layers, L], over the node pairs ``mask`` [K, K] keeps (the
    graph's edges: all, ranked or self, the DAG config's ``edge_mask``)."""
    mag = np.abs(gates)[:, :, :, mask]                                  # [layers, L, T, P, dg]
    below = (mag < threshold).sum(axis=(2, 3, 4))
    pairs_below = (mag.mean(axis=-1) < threshold).sum(axis=(2, 3))
    t, p, dg = mag.shape[2:]
    return below, pairs_below, t * p * dg, t * p


@nnx.jit
def _forward(model, tokens, inputs):
    logits, aux = model(tokens, **inputs)
    return logits, aux.get("intermediates", {})


def record(model, tokens, **inputs) -> Dict[str, object]:
    """Logits [B, S, V] and the intermediates the model records for ``tokens`` [B, S]:
    ``indices`` [layers, C, T, K] and, for a DAG model, ``edge_gates`` [layers, L, T, K, K, d_g]
    and ``dag_inputs`` [layers, L, T, K, d], with T = B * S row-major; for a DoE model
    ``gates`` [layers, B, S, K]. ``inputs``: the model's other inputs (a DoE model's
    ``features={'topics': ...}``). The model's recording flag is switched on for this call only."""
    model.set_attributes(record_intermediates=True, raise_if_not_found=False)
    try:
        logits, kept = _forward(model, jnp.asarray(tokens, jnp.int32), inputs)
    finally:
        model.set_attributes(record_intermediates=False, raise_if_not_found=False)
    return {"logits": logits, **kept}


@dataclasses.dataclass
class Collected:
    """Statistics of a model's routing and DAG gates over the non-padding tokens of a dataset.

    tokens: tokens analysed. block, aggregation: the model's block family and its aggregator
      kind (None for families without one).
    expert_load [layers, N]: share of routing slots per expert (all iterations, for CoE).
    coactivation [layers, C - 1, N, N] or None: CoE only; entry (l, t, a, b) counts tokens that
    used expert a in iteration t and expert b in iteration t + 1 (CoE Figure 8).
    gate_mean, gate_std [layers, L, K, K] or None: DAG only; per token the gate magnitude of a
    node pair is the mean over d_g of |e_(i,j)|; these are its mean and standard deviation over
    tokens (row i: receiving node, column j: sending node, rank order).
    gate_samples [layers, L, M, K, K] or None: the per-token magnitudes of up to M tokens (for
    histograms).
    gate_sparsity, pair_sparsity [layers, L] or None: DAG only; the share of edge-gate values
    |e_(i,j)| (every token, d_g channel and node pair the graph has) below
    :data:`SPARSITY_THRESHOLD`, and the share of (token, node pair) whose magnitude (mean over
    d_g of |e_(i,j)|) is below it: the edges the learned gates all but switch off.
    """

    tokens: int
    block: str
    aggregation: Optional[str]
    expert_load: Optional[np.ndarray]
    coactivation: Optional[np.ndarray]
    gate_mean: Optional[np.ndarray]
    gate_std: Optional[np.ndarray]
    gate_samples: Optional[np.ndarray]
    gate_sparsity: Optional[np.ndarray] = None
    pair_sparsity: Optional[np.ndarray] = None
    sparsity_threshold: float = 0.0


def collect(model, batches: Iterable[Dict[str, np.ndarray]], max_samples: int = 4096) -> Collected:
    """Run ``model`` over ``batches`` (dicts with ``inputs`` and ``mask`` [B, S]) recording its
    intermediates (:func:`record`) and reduce them.

    Padding positions (``mask`` False) are left out of every statistic.
    """
    cfg = model.cfg
    experts = experts_of(cfg.block)                    # None: the family does not route
    routed = experts is not None
    n = experts.num_experts if routed else 0
    layers = cfg.routed_layers                         # the layers that route
    load = np.zeros((layers, n)) if routed else None
    coact = None
    steps = routing_steps(cfg.block)
    if steps > 1:                                       # CoE: one iteration to the next
        coact = np.zeros((layers, steps - 1, n, n))
    dag = dag_aggregation_of(cfg.block)
    is_dag = dag is not None
    mask = dag.edge_mask(cfg.block.router.top_k) if is_dag else None
    g_sum = g_sq = None
    sparse = [0, 0, 0, 0]      # values below, pairs below, values, pairs
    samples: List[np.ndarray] = []
    count = 0
    for batch in batches:
        keep = np.asarray(batch["mask"], bool).reshape(-1)
        if not keep.any():
            continue
        kept = record(model, batch["inputs"])
        count += int(keep.sum())
        if not routed:
            continue
        ids = np.asarray(kept["indices"])[:, :, keep]                        # [layers, C, T', K]
        for l in range(layers):
            load[l] += np.bincount(ids[l].reshape(-1), minlength=n)
            if coact is not None:
                onehot = (ids[l][..., None] == np.arange(n)).any(axis=2).astype(np.float64)
                for t in range(ids.shape[1] - 1):
                    coact[l, t] += onehot[t].T @ onehot[t + 1]
        if is_dag:
            gates = np.asarray(kept["edge_gates"])[:, :, keep]               # [layers, L, T', K, K, dg]
            mag = np.abs(gates).mean(axis=-1)                                 # [layers, L, T', K, K]
            g_sum = mag.sum(axis=2) if g_sum is None else g_sum + mag.sum(axis=2)
            g_sq = (mag ** 2).sum(axis=2) if g_sq is None else g_sq + (mag ** 2).sum(axis=2)
            counts = gate_sparsity_counts(gates, mask, SPARSITY_THRESHOLD)
            sparse = [a + b for a, b in zip(sparse, counts)]
            if sum(s.shape[2] for s in samples) < max_samples:
                samples.append(mag)
    if count == 0:
        raise ValueError("the data has no (non-padding) tokens to analyse")
    if load is not None:
        load = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
    gate_mean = gate_std = gate_samples = gate_sparsity = pair_sparsity = None
    if is_dag:
        gate_sparsity, pair_sparsity = sparse[0] / sparse[2], sparse[1] / sparse[3]
        gate_mean = g_sum / count
        gate_std = np.sqrt(np.maximum(g_sq / count - gate_mean ** 2, 0.0))
        gate_samples = np.concatenate(samples, axis=2)[:, :, :max_samples]
    aggregation = aggregation_of(cfg.block)
    return Collected(tokens=count, block=cfg.block.kind,
                     aggregation=aggregation.kind if aggregation else None,
                     expert_load=load, coactivation=coact, gate_mean=gate_mean,
                     gate_std=gate_std, gate_samples=gate_samples,
                     gate_sparsity=gate_sparsity, pair_sparsity=pair_sparsity,
                     sparsity_threshold=SPARSITY_THRESHOLD)
