"""Shared building blocks: parameter creation with logical axes, RMSNorm, SwiGLU."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

Shape = Tuple[int, ...]


def dtype_of(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def make_param(rngs: nnx.Rngs, init: Callable, shape: Shape, names: Sequence[Optional[str]],
               dtype=jnp.float32) -> nnx.Param:
    """A parameter initialised with ``init`` whose metadata carries its logical axis ``names``."""
    if len(names) != len(shape):
        raise ValueError(f"make_param: axis names {tuple(names)} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(names),
                     eager_sharding=False)


def normal(std: float) -> Callable:
    return nnx.initializers.normal(std)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Llama): ``x / sqrt(mean(x^2) + eps) * scale``, statistics in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
           fused: bool = True) -> jax.Array:
    """SwiGLU FFN (Llama): ``(silu(x W_gate) * (x W_up)) W_down``.

    ``fused``: ``x W_gate`` and ``x W_up`` are computed as one matmul against
    ``[W_gate | W_up]`` (the same products, column by column): one pass over x and, in the
    backward pass, one input gradient of twice the depth instead of two and an add. Measured 3%
    faster for the whole training step of the s model on the 2-core CPU, concatenation
    included. Under a multi-device mesh (``ExecutionConfig.fuse_projections`` settles to False
    there) the two matmuls stay separate: concatenating weights sharded along their hidden axis
    (tensor parallelism) would move them between devices.
    """
    if not fused:
        return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down
    h = w_gate.shape[-1]
    gate_up = x @ jnp.concatenate([w_gate, w_up], axis=-1)
    return (jax.nn.silu(gate_up[..., :h]) * gate_up[..., h:]) @ w_down


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = make_param(rngs, nnx.initializers.ones, (dim,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class SwiGLU(nnx.Module):
    """A dense SwiGLU FFN: the 'dense' block and the shared experts.

    ``num_shared`` shared experts of hidden ``h`` are one SwiGLU of hidden ``num_shared * h``:
    the sum of the separate experts' outputs is exactly that FFN's output.
    """

    def __init__(self, d_model: int, hidden: int, std: float, dtype, *,
                 fuse_projections: bool = True, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.dtype, self.fuse_projections = dtype, fuse_projections
        init, pd = normal(std), param_dtype
        self.w_gate = make_param(rngs, init, (d_model, hidden), ("embed", "mlp"), pd)
        self.w_up = make_param(rngs, init, (d_model, hidden), ("embed", "mlp"), pd)
        self.w_down = make_param(rngs, init, (hidden, d_model), ("mlp", "embed"), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = lambda w: w[...].astype(self.dtype)
        return swiglu(x.astype(self.dtype), c(self.w_gate), c(self.w_up), c(self.w_down),
                      fused=self.fuse_projections)
