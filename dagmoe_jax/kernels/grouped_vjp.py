"""What the grouped matmul kernels share (the CPU one of :mod:`.grouped_matmul`, the GPU ones of
:mod:`.gpu_grouped_matmul`): one ``jax.custom_vjp`` over a forward, an input-gradient and a
weight-gradient kernel, and the checks of their operands."""

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
    group). Each callable gives zeros for rows past ``sum(sizes)`` and takes the cotangent in
    the output's dtype; the gradients are cast back to the operands' dtypes."""

    @jax.custom_vjp
    def grouped(lhs, rhs, sizes):
        return forward(lhs, rhs, sizes)

    def fwd(lhs, rhs, sizes):
        return forward(lhs, rhs, sizes), (lhs, rhs, sizes)

    def bwd(res, dy):
        lhs, rhs, sizes = res
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


def checked_call(name: str, unsupported: Callable, impl: Callable, lhs, rhs, sizes):
    """``impl(lhs, rhs, sizes)`` on operands cast to their common dtype, after
    :func:`check_operands` and ``unsupported(K, N, dtype)`` (a reason, or None) have passed:
    else a one-line ``ValueError`` that names ``ragged_dot`` as the way out."""
    check_operands(name, lhs, rhs, sizes)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    reason = unsupported(lhs.shape[1], rhs.shape[2], dtype)
    if reason:
        raise ValueError(f"{reason}: use ExecutionConfig.grouped_matmul='ragged_dot'")
    return impl(lhs.astype(dtype), rhs.astype(dtype), sizes)
