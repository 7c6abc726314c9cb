"""Aggregators: how the K selected expert outputs become the block output (docs/design.md section 4).

* ``sum``: the standard weighted sum (DAG-MoE eq. 1).
* ``dag``: the DAG learning module (DAG-MoE eq. 6-12), its own package
  :mod:`dagmoe_jax.families.moe.dag`.
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
from flax import nnx

from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.families.moe.config import AggregationConfig
from dagmoe_jax.families.moe.dag import DAGAggregator, layer_norm
from dagmoe_jax.model.layers import make_param, normal


def weighted_sum(gates: jax.Array, expert_out: jax.Array) -> jax.Array:
    """DAG-MoE eq. 1: y = sum_k g_k E_k(x)."""
    return jnp.einsum("tk,tkd->td", gates.astype(expert_out.dtype), expert_out)


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
    """:func:`mlp_mix` with its weights, built from its own ``AggregationConfig`` (kind 'mlp':
    d_g = ``dag_dim``), the model width d, the initialisation's ``std`` (W_3 starts at zero:
    the weighted sum at initialisation), the LayerNorm's ``eps`` and the parameters' dtype."""

    def __init__(self, cfg: AggregationConfig, d_model: int, *, std: float, eps: float,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        d, dg = d_model, cfg.dag_dim
        self.eps = eps
        pd = param_dtype
        self.w_1 = make_param(rngs, normal(std), (d, dg), ("embed", "dag"), pd)
        self.w_2 = make_param(rngs, normal(std), (d, dg), ("embed", "dag"), pd)
        self.w_3 = make_param(rngs, nnx.initializers.zeros, (dg, d), ("dag", "embed"), pd)

    def __call__(self, x, gates, expert_out):
        return mlp_mix(weighted_sum(gates, expert_out), self.w_1[...], self.w_2[...], self.w_3[...],
                       self.eps), {}


class SumAggregator(nnx.Module):
    """:func:`weighted_sum`: no parameters."""

    def __call__(self, x, gates, expert_out):
        return weighted_sum(gates, expert_out), {}


def make_aggregator(cfg: AggregationConfig, d_model: int, *, std: float, eps: float,
                    param_dtype=jnp.float32, execution: Optional[ExecutionConfig] = None,
                    rngs: nnx.Rngs) -> nnx.Module:
    """The aggregator ``cfg.kind`` names, built from its own config and the model's width,
    initialisation scale, LayerNorm epsilon and parameter dtype (the DAG module also from the
    settled ``execution``)."""
    common = dict(std=std, eps=eps, param_dtype=param_dtype, rngs=rngs)
    if cfg.kind == "dag":
        return DAGAggregator(cfg, d_model, execution=execution, **common)
    if cfg.kind == "mlp":
        return MLPMixer(cfg, d_model, **common)
    return SumAggregator()
