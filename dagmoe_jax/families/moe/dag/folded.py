"""DAG-MoE eq. 7-8 as one product on the raw nodes: the LayerNorm folded into W_down.

u = LayerNorm(x) W_down with LayerNorm(x) = x_hat * gamma + beta and x_hat = (x - mu) rho
(mu the mean, rho = 1 / sqrt(var + eps), per node) is, by linearity,

    u = rho * (x W' - mu * 1^T W') + beta W_down,    W' = diag(gamma) W_down,

so the normalised nodes, a [T*K, d] array, are never built: the forward reads the nodes once
for their statistics and once in the product, and autodiff's backward is two products over
the nodes and one elementwise pass (the LayerNorm's gradient reduces to per-node scalars from
[T*K, d_g] arrays). The product accumulates in float32, so subtracting mu 1^T W' loses no
more than the LayerNorm's own float32 statistics; the products take W' rounded to the nodes'
dtype where the composed form rounds x_hat * gamma + beta.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dagmoe_jax.families.moe.dag.equations import layer_norm_statistics


def folded_norm_projection(x: jax.Array, scale: jax.Array, bias: jax.Array, w_down: jax.Array,
                           eps: float) -> jax.Array:
    """DAG-MoE eq. 7-8, ``layer_norm(x, scale, bias, eps) @ w_down`` for node rows x [N, d],
    as the folded product (module docstring); [N, d_g] in ``x``'s dtype."""
    dtype, f32 = x.dtype, jnp.float32
    mean, rstd = layer_norm_statistics(x.astype(f32), eps)           # eq. 7's, [N, 1]
    w = scale.astype(f32)[:, None] * w_down.astype(f32)              # diag(gamma) W_down
    w_q = w.astype(dtype)                                            # what the product takes
    xw = jnp.dot(x, w_q, preferred_element_type=f32)                 # x W'  [N, d_g]
    shift = bias.astype(f32) @ w_down.astype(f32)                    # beta W_down  [d_g]
    u = rstd * (xw - mean * jnp.sum(w_q.astype(f32), axis=0)) + shift
    return u.astype(dtype)
