"""What the GPU grouped matmuls share: one ``jax.custom_vjp`` over a forward, an input-gradient
and a weight-gradient kernel, and the checks of their operands
(:mod:`dagmoe_jax.kernels.gpu_grouped_matmul`)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp



def valid_rows(m: int, sizes: jax.Array) -> jax.Array:
    """[m, 1] bool: row i lies inside a group (i < sum(sizes))."""
    return (jnp.arange(m, dtype=jnp.int32) < jnp.sum(sizes))[:, None]


@functools.lru_cache(maxsize=None)
def grouped_vjp(forward: Callable, input_grad: Callable, weight_grad: Callable) -> Callable:
    """``f(lhs [M, K], rhs [G, K, N], sizes [G]) -> [M, N]`` differentiable in lhs and rhs:
    ``forward(lhs, rhs, sizes)``; backward ``input_grad(dy, rhs, sizes)`` (dy @ rhs[g]^T per
    group) and ``weight_grad(lhs, dy, sizes)`` ([G, K, N]: lhs_g^T @ dy_g, zero for an empty
    group). Each callable gives zeros for rows past ``sum(sizes)``."""

    @jax.custom_vjp
    def grouped(lhs, rhs, sizes):
        return forward(lhs, rhs, sizes)

    def fwd(lhs, rhs, sizes):
        return forward(lhs, rhs, sizes), (lhs, rhs, sizes)

    def bwd(res, dy):
        lhs, rhs, sizes = res
        dy = dy.astype(lhs.dtype)
        return (input_grad(dy, rhs, sizes).astype(lhs.dtype),
                weight_grad(lhs, dy, sizes).astype(rhs.dtype), None)

    grouped.defvjp(fwd, bwd)
    return grouped


def check_operands(name: str, lhs, rhs, sizes) -> None:
    """One-line ValueError for operands no grouped matmul can take."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"{name} grouped matmul: expected lhs [M, K] and rhs [G, K, N], got "
                         f"{tuple(lhs.shape)} and {tuple(rhs.shape)}")
    if tuple(sizes.shape) != (rhs.shape[0],) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(f"{name} grouped matmul: sizes must be integer [G] = [{rhs.shape[0]}], "
                         f"got {sizes.dtype} {tuple(sizes.shape)}")
