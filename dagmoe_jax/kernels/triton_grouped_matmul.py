"""Dropless dispatch's grouped matmul on Ampere and newer (sm80+): a Pallas Triton kernel of this
library's, forward and input gradient (:func:`_gmm_kernel`: one program per row tile of a group
and output column tile) and weight gradient (:func:`_tgmm_kernel`: one program per group and
weight tile, looping over the group's rows), tied by one custom VJP: the design card's A100
path (``ExecutionConfig.grouped_matmul='triton'``; :mod:`dagmoe_jax.kernels.gpu_grouped_matmul`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from dagmoe_jax.kernels.grouped_vjp import checked_call, grouped_vjp


@dataclasses.dataclass(frozen=True)
class TritonBlocks:
    """Tiles of the Triton kernels: a ``block_m`` x ``block_n`` output tile accumulated over
    ``block_k``-deep steps (in the weight gradient, ``block_m`` rows of the group a step and a
    ``block_k`` x ``block_n`` tile of the weight), ``num_warps`` warps, ``num_stages`` stages
    of Triton's software pipeline."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


TRITON_DIM = 16
"""Expert dims must be multiples of this for 'triton' (Triton's smallest dot tile)."""


def triton_unsupported(d_model: int, hidden: int, dtype) -> Optional[str]:
    """Why the Triton kernels cannot take experts of ``d_model`` x ``hidden`` in ``dtype``."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"the Triton kernels take float32 or 16-bit operands ({jnp.dtype(dtype).name})"
    if d_model % TRITON_DIM or hidden % TRITON_DIM:
        return (f"the Triton kernels need d_model and the expert hidden size to be multiples "
                f"of {TRITON_DIM} (got {d_model} and {hidden})")
    return None


def _divisor_tile(dim: int, largest: int) -> int:
    """The largest of ``largest``, its halves, ... down to 16 that divides ``dim``."""
    tile = largest
    while tile > TRITON_DIM and dim % tile:
        tile //= 2
    return tile


def triton_blocks(m: int, k: int, n: int, itemsize: int) -> TritonBlocks:
    """Tiles for an [m, k] x [k, n] grouped product: 128 x 128 output tiles (64 rows for a
    short M), 64 deep for 16-bit operands and 32 for float32 (shared memory), each cut to a
    divisor of its dim."""
    return TritonBlocks(block_m=128 if m >= 1024 else 64, block_n=_divisor_tile(n, 128),
                        block_k=_divisor_tile(k, 64 if itemsize == 2 else 32),
                        num_warps=8 if m >= 1024 else 4, num_stages=3)


def triton_weight_blocks(k: int, n: int, itemsize: int) -> TritonBlocks:
    """The weight gradient's tiles for [G, k, n]: a 64 x 128 tile of the weight (each cut to a
    divisor), 64 rows of the group a step (32 for float32)."""
    return TritonBlocks(block_m=64 if itemsize == 2 else 32, block_n=_divisor_tile(n, 128),
                        block_k=_divisor_tile(k, 64), num_warps=4, num_stages=3)


def _tile_plan(sizes: jax.Array, m_pad: int, block_m: int):
    """The row tiles of the forward kernel, four int32 [T] arrays (T = m_pad / block_m + G,
    a static bound): each tile's row block, the row range [lo, hi) of its group, and the
    group (G for the rows past ``sum(sizes)``, which the kernel writes as zeros). A tile that
    straddles a group boundary appears once per group; spare tiles have lo = hi (no rows)."""
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    starts = ends - sizes.astype(jnp.int32)
    starts = jnp.append(starts, ends[-1])                        # group G: the padding rows
    ends = jnp.append(ends, jnp.int32(m_pad))
    first = starts // block_m
    count = jnp.where(ends > starts, (ends + block_m - 1) // block_m - first, 0)
    tile_end = jnp.cumsum(count)
    t = jnp.arange(m_pad // block_m + g, dtype=jnp.int32)
    group = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)   # G + 1: spare
    spare = group > g
    group = jnp.minimum(group, g)
    block = first[group] + t - (tile_end[group] - count[group])
    zero = jnp.zeros_like(t)
    return (jnp.where(spare, zero, block), jnp.where(spare, zero, starts[group]),
            jnp.where(spare, zero, ends[group]), group)


def _gmm_kernel(block_ref, lo_ref, hi_ref, group_ref, x_ref, w_ref, o_ref, *,
                blocks: TritonBlocks, groups: int, contracted: int, transpose_rhs: bool):
    """One [block_m, block_n] tile of ``x [M, K] @ w[g]`` (``w[g]^T`` when ``transpose_rhs``)
    for the rows of one group: rows outside [lo, hi) are neither read nor written; the
    padding group (g = G) writes zeros."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    t, j = pl.program_id(0), pl.program_id(1)
    row0 = block_ref[t] * bm
    rows = row0 + jnp.arange(bm, dtype=jnp.int32)
    inside = ((rows >= lo_ref[t]) & (rows < hi_ref[t]))[:, None]
    group = group_ref[t]
    weight = jnp.minimum(group, groups - 1)

    def step(i, acc):
        x = plgpu.load(x_ref.at[pl.ds(row0, bm), pl.ds(i * bk, bk)], mask=inside, other=0.0)
        if transpose_rhs:
            w = plgpu.load(w_ref.at[weight, pl.ds(j * bn, bn), pl.ds(i * bk, bk)])
            return acc + plgpu.dot(x, w, trans_b=True)
        w = plgpu.load(w_ref.at[weight, pl.ds(i * bk, bk), pl.ds(j * bn, bn)])
        return acc + plgpu.dot(x, w)

    # (a scalar select of two constants lowers to an i1 loop bound in Triton: multiply)
    steps = (group < groups).astype(jnp.int32) * jnp.int32(contracted // bk)
    acc = lax.fori_loop(jnp.int32(0), steps, step, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(o_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
                mask=inside)


def _tgmm_kernel(lo_ref, hi_ref, x_ref, dy_ref, o_ref, *, blocks: TritonBlocks):
    """One [block_k, block_n] tile of group g's ``x_g^T @ dy_g``: the group's rows in
    ``block_m`` steps aligned to the row tiles, masked to [lo, hi); an empty group gives
    zeros."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[g], hi_ref[g]
    first = lo // bm
    steps = jnp.where(hi > lo, (hi + bm - 1) // bm - first, 0).astype(jnp.int32)

    def step(s, acc):
        row0 = (first + s) * bm
        rows = row0 + jnp.arange(bm, dtype=jnp.int32)
        inside = ((rows >= lo) & (rows < hi))[:, None]
        x = plgpu.load(x_ref.at[pl.ds(row0, bm), pl.ds(i * bk, bk)], mask=inside, other=0.0)
        dy = plgpu.load(dy_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)], mask=inside, other=0.0)
        return acc + plgpu.dot(x, dy, trans_a=True)

    acc = lax.fori_loop(jnp.int32(0), steps, step, jnp.zeros((bk, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad_rows(x: jax.Array, multiple: int) -> jax.Array:
    """``x`` with zero rows appended up to a multiple of ``multiple`` (none when it is one)."""
    extra = -x.shape[0] % multiple
    return jnp.pad(x, ((0, extra), (0, 0))) if extra else x


def triton_product(x, w, sizes, *, transpose_rhs: bool = False, interpret: bool = False,
                   blocks: Optional[TritonBlocks] = None):
    """``x [M, C] @ w[g]`` ([G, C, N]) or, with ``transpose_rhs``, ``@ w[g]^T`` ([G, N, C]),
    by :func:`_gmm_kernel` with ``blocks`` (default :func:`triton_blocks`'s; the GPU check
    times others); rows past sum(sizes) are zeros. Not differentiable: the forward half."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    m, c = x.shape
    groups = w.shape[0]
    n = w.shape[1] if transpose_rhs else w.shape[2]
    blocks = blocks or triton_blocks(m, c, n, jnp.dtype(x.dtype).itemsize)
    xp = _pad_rows(x, blocks.block_m)
    m_pad = xp.shape[0]
    plan = _tile_plan(sizes, m_pad, blocks.block_m)
    kernel = functools.partial(_gmm_kernel, blocks=blocks, groups=groups, contracted=c,
                               transpose_rhs=transpose_rhs)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
        grid=(plan[0].shape[0], n // blocks.block_n),
        in_specs=[pl.no_block_spec] * 6, out_specs=pl.no_block_spec,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret, name="dagmoe_triton_gmm")(*plan, xp, w)
    return out[:m] if m_pad != m else out


def triton_weight_grad(x, dy, sizes, *, interpret: bool = False,
                       blocks: Optional[TritonBlocks] = None):
    """[G, K, N]: ``x_g^T @ dy_g`` per group by :func:`_tgmm_kernel` with ``blocks`` (default
    :func:`triton_weight_blocks`'s)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    k, n = x.shape[1], dy.shape[1]
    groups = sizes.shape[0]
    blocks = blocks or triton_weight_blocks(k, n, jnp.dtype(x.dtype).itemsize)
    xp, dyp = _pad_rows(x, blocks.block_m), _pad_rows(dy, blocks.block_m)
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    kernel = functools.partial(_tgmm_kernel, blocks=blocks)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((groups, k, n), x.dtype),
        grid=(groups, k // blocks.block_k, n // blocks.block_n),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.BlockSpec((None, blocks.block_k, blocks.block_n),
                               lambda g, i, j: (g, i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret, name="dagmoe_triton_tgmm")(ends - sizes.astype(jnp.int32), ends,
                                                         xp, dyp)


@functools.lru_cache(maxsize=None)
def _triton_impl(interpret: bool) -> Callable:
    return grouped_vjp(
        functools.partial(triton_product, transpose_rhs=False, interpret=interpret),
        functools.partial(triton_product, transpose_rhs=True, interpret=interpret),
        functools.partial(triton_weight_grad, interpret=interpret))


def triton_grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, *,
                          interpret: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, sizes)`` by this library's Pallas Triton kernels
    (Ampere and newer): rows of ``lhs`` [M, K] sorted by group, group g's ``sizes[g]`` rows
    times ``rhs[g]`` [K, N]; rows past ``sum(sizes)`` give zeros. Operands cast to their
    common type (float32 or 16-bit), K and N multiples of :data:`TRITON_DIM`; accumulation in
    float32. Differentiable in lhs and rhs; ``interpret`` runs the kernels in the Pallas
    interpreter (any backend)."""
    return checked_call("triton", triton_unsupported, _triton_impl(interpret), lhs, rhs, sizes)
