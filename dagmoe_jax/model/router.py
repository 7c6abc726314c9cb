"""Token-choice router: scores, top-K gates and the two router losses (DESIGN.md section 2)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.model.layers import make_param, normal


class Routing(NamedTuple):
    """One routing decision for T tokens.

    gates [T, K]: g_k of the selected experts in rank order (highest score first);
    indices [T, K]: their expert ids, the node order of the DAG (DAG-MoE eq. 3, list k);
    logits [T, N] float32 and scores [T, N]: for the losses and for analysis.
    """

    gates: jax.Array
    indices: jax.Array
    logits: jax.Array
    scores: jax.Array


def router_logits(x: jax.Array, w_router: jax.Array) -> jax.Array:
    """z_i = x . e_i, computed in float32 (DAG-MoE sec. 2; Switch router)."""
    return jnp.einsum("td,dn->tn", x.astype(jnp.float32), w_router.astype(jnp.float32))


def router_scores(logits: jax.Array, score_fn: str) -> jax.Array:
    """s = sigmoid(z) (DAG-MoE Appendix B.1) or softmax(z) (Switch; CoE eq. 7)."""
    if score_fn == "sigmoid":
        return jax.nn.sigmoid(logits)
    if score_fn == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"router score_fn={score_fn!r} is invalid: expected 'sigmoid' or 'softmax'")


def select_top_k(scores: jax.Array, k: int, renormalize: bool):
    """Top-K gating, DAG-MoE eq. 1 / CoE eq. 7: g_i = s_i for the K best experts, else 0.

    Returns gates and indices [T, K] in descending score order; ties go to the lower expert id,
    so the node order is deterministic. ``renormalize`` divides the gates by their sum.
    """
    gates, indices = jax.lax.top_k(scores, k)
    if renormalize:
        gates = gates / jnp.maximum(jnp.sum(gates, axis=-1, keepdims=True), 1e-9)
    return gates, indices


def expert_load(indices: jax.Array, num_experts: int) -> jax.Array:
    """f_i: share of the T * K routing slots that went to expert i ([N], sums to 1)."""
    counts = jnp.zeros((num_experts,), jnp.float32).at[indices.reshape(-1)].add(1.0)
    return counts / indices.size


def balance_loss(scores: jax.Array, indices: jax.Array, score_fn: str) -> jax.Array:
    """Switch balance loss ``N * sum_i f_i * P_i`` (DESIGN.md section 2).

    f_i is :func:`expert_load`; P_i the mean over tokens of the normalised score (the softmax
    probability, or s_i / sum_j s_j for sigmoid scores, our reading). Equals 1 when uniform.
    """
    n = scores.shape[-1]
    probs = scores if score_fn == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return n * jnp.sum(expert_load(indices, n) * jnp.mean(probs.astype(jnp.float32), axis=0))


def z_loss(logits: jax.Array) -> jax.Array:
    """Router z-loss (ST-MoE): ``mean_t (logsumexp_i z_ti)^2``."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


class Router(nnx.Module):
    """Router keys e_i as a [d, N] matrix; returns a :class:`Routing` for tokens [T, d]."""

    def __init__(self, d_model: int, num_experts: int, std: float, *, rngs: nnx.Rngs):
        self.w_router = make_param(rngs, normal(std), (d_model, num_experts), ("embed", None))

    def __call__(self, x: jax.Array, top_k: int, score_fn: str, renormalize: bool) -> Routing:
        logits = router_logits(x, self.w_router[...])
        scores = router_scores(logits, score_fn)
        gates, indices = select_top_k(scores, top_k, renormalize)
        return Routing(gates.astype(x.dtype), indices, logits, scores)

    @staticmethod
    def losses(routing: Routing, score_fn: str) -> dict:
        n = routing.scores.shape[-1]
        return {
            "balance_loss": balance_loss(routing.scores, routing.indices, score_fn),
            "z_loss": z_loss(routing.logits),
            "expert_load": expert_load(routing.indices, n),
        }
