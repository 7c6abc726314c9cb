"""Dropless dispatch's grouped matmul on Hopper (sm90): JAX's in-tree Mosaic GPU kernels,
``ragged_dot_mgpu.ragged_dot`` for the forward and (with ``transpose_rhs``) the input gradient,
``transposed_ragged_dot_mgpu.transposed_ragged_dot`` for the weight gradient (warpgroup MMAs
fed by TMA, a persistent grid of one program per SM), tied by one custom VJP
(``ExecutionConfig.grouped_matmul='mgpu'``; :mod:`dagmoe_jax.kernels.gpu_grouped_matmul`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp

from dagmoe_jax.kernels.grouped_vjp import checked_call, grouped_vjp, valid_rows

H100_SMS = 132
"""Streaming multiprocessors of an H100 / H200 SXM: the persistent grid of the Mosaic GPU
forward kernel is hard-coded to it; its weight gradient asks ``jax.devices()[0]``."""


@dataclasses.dataclass(frozen=True)
class MgpuBlocks:
    """Tiles of the Mosaic GPU kernels (their keyword arguments): an output tile of
    ``block_m`` x ``block_n``, ``block_k`` deep, ``max_concurrent_steps`` TMA stages in flight,
    ``grid_block_n`` output tiles along N visited together (the kernels' planar snake)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 2

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


MGPU_DIM = 64
"""Expert dims (d_model, the expert hidden size) must be multiples of this for 'mgpu': the
forward's ``block_k`` divides the contracted dim, the weight gradient's tiles divide both."""


def mgpu_unsupported(d_model: int, hidden: int, dtype) -> Optional[str]:
    """Why the Mosaic GPU kernels cannot take experts of ``d_model`` x ``hidden`` in
    ``dtype`` (None when they can)."""
    if jnp.dtype(dtype).itemsize != 2:
        return f"the Mosaic GPU kernels take 16-bit operands (compute dtype {jnp.dtype(dtype).name})"
    if d_model % MGPU_DIM or hidden % MGPU_DIM:
        return (f"the Mosaic GPU kernels need d_model and the expert hidden size to be "
                f"multiples of {MGPU_DIM} (got {d_model} and {hidden})")
    return None


def mgpu_blocks(m: int, k: int, n: int) -> MgpuBlocks:
    """The forward / input-gradient tiles for an [m, k] x [k, n] grouped product, 64 deep with
    2 to 4 stages in flight (2 at least: the kernel's pipeline releases a stage one step late,
    and 1 is refused at d 64): for many rows, 64 x 256 output tiles where N takes them (on an
    H200 at MoE-l's [65,536, 1,024] x [1,024, 512], the best of the 8 tiles
    ``benchmarks/gpu_check.py`` times; benchmarks/RESULTS.md), else 128 x 128, each 64 where
    M is short or N not a multiple of 128; the snake visits 2 column tiles where N has 4 (2
    for the 256-wide ones) or more."""
    steps = max(2, min(4, k // 64))
    if m >= 128 * 8 and n % 256 == 0:
        return MgpuBlocks(block_m=64, block_n=256, block_k=64, max_concurrent_steps=steps,
                          grid_block_n=2 if n >= 2 * 256 else 1)
    block_n = 128 if n % 128 == 0 else 64
    block_m = 128 if m >= 128 * 8 else 64
    return MgpuBlocks(block_m=block_m, block_n=block_n, block_k=64,
                      max_concurrent_steps=steps, grid_block_n=2 if n >= 4 * block_n else 1)


def mgpu_weight_blocks(k: int, n: int) -> MgpuBlocks:
    """The weight gradient's tiles for [G, k, n]: an output tile dividing both (128 or 64),
    128 rows of the group deep (on an H200 at MoE-l's [1,024, 512] the best of the 8 tiles
    ``benchmarks/gpu_check.py`` times, ahead of 64 deep; benchmarks/RESULTS.md), 2 stages."""
    return MgpuBlocks(block_m=128 if k % 128 == 0 else 64, block_n=128 if n % 128 == 0 else 64,
                      block_k=128, max_concurrent_steps=2, grid_block_n=1)


_SM_COUNT: Optional[int] = None


@contextlib.contextmanager
def mosaic_gpu_target(sm_count: int) -> Iterator[None]:
    """Trace the Mosaic GPU weight gradient for a GPU of ``sm_count`` SMs when the process's
    default device is not that GPU (compiling deviceless for a GPU target from a CPU host:
    the kernel sizes its persistent grid from ``jax.devices()[0].core_count``)."""
    global _SM_COUNT
    previous, _SM_COUNT = _SM_COUNT, sm_count
    try:
        yield
    finally:
        _SM_COUNT = previous


def _sm_count() -> int:
    """SMs of the GPU the weight gradient is traced for: the target's, else the default
    device's, else an H100's."""
    if _SM_COUNT is not None:
        return _SM_COUNT
    return int(getattr(jax.devices()[0], "core_count", 0) or H100_SMS)


@functools.lru_cache(maxsize=None)
def _mgpu_modules():
    """JAX's in-tree kernels (imported on first use: they import ``jax._src.test_util``,
    which needs absl-py)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


@contextlib.contextmanager
def _devices_report(sm_count: int, module) -> Iterator[None]:
    """Within the block, ``module``'s ``jax.devices()`` answers one device of ``sm_count``
    SMs (the weight-gradient kernel reads its grid size there; the rest of ``jax`` is
    untouched)."""
    original = module.jax
    view = types.SimpleNamespace(**{k: getattr(jax, k) for k in dir(jax)
                                    if not k.startswith("__")})
    view.devices = lambda *_a, **_k: [types.SimpleNamespace(core_count=sm_count)]
    module.jax = view
    try:
        yield
    finally:
        module.jax = original


def _mgpu_forward(lhs, rhs, sizes):
    rd, _ = _mgpu_modules()
    m, k = lhs.shape
    blocks = mgpu_blocks(m, k, rhs.shape[2])
    out = rd.ragged_dot(lhs, rhs, group_sizes=sizes.astype(jnp.int32), **blocks.kwargs())
    # the kernel leaves rows outside every group unwritten
    return jnp.where(valid_rows(m, sizes), out, 0)


def _mgpu_input_grad(dy, rhs, sizes):
    rd, _ = _mgpu_modules()
    m, n = dy.shape
    blocks = mgpu_blocks(m, n, rhs.shape[1])
    dx = rd.ragged_dot(dy, rhs, group_sizes=sizes.astype(jnp.int32), transpose_rhs=True,
                       **blocks.kwargs())
    return jnp.where(valid_rows(m, sizes), dx, 0)


def _mgpu_weight_grad(lhs, dy, sizes):
    _, trd = _mgpu_modules()
    k, n = lhs.shape[1], dy.shape[1]
    blocks = mgpu_weight_blocks(k, n)
    # the kernel contracts the rows of the group: lhs^T [K, M] against dy [M, N]; rows past
    # sum(sizes) belong to no group
    with _devices_report(_sm_count(), trd):
        return trd.transposed_ragged_dot(lhs, dy, group_sizes=sizes.astype(jnp.int32),
                                         **blocks.kwargs())


def _mgpu_interpret(fn: Callable) -> Callable:
    """``fn`` run under Mosaic GPU's interpreter (CPU, slow, exact)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    try:
        force, params = plgpu.force_gpu_interpret_mode, plgpu.InterpretGPUParams
    except AttributeError:         # jax 0.10: not yet exported
        from jax._src.pallas.mosaic_gpu.interpret.params import (
            InterpretGPUParams as params, force_gpu_interpret_mode as force)

    @functools.wraps(fn)
    def run(*args):
        with force(params()):
            return fn(*args)
    return run


@functools.lru_cache(maxsize=None)
def _mgpu_impl(interpret: bool) -> Callable:
    parts = (_mgpu_forward, _mgpu_input_grad, _mgpu_weight_grad)
    if interpret:
        parts = tuple(_mgpu_interpret(p) for p in parts)
    return grouped_vjp(*parts)


def mgpu_grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, *,
                        interpret: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, sizes)`` by JAX's Mosaic GPU kernels (Hopper): rows of
    ``lhs`` [M, K] sorted by group, group g's ``sizes[g]`` rows times ``rhs[g]`` [K, N]; rows
    past ``sum(sizes)`` give zeros. 16-bit operands (cast to their common type), K and N
    multiples of :data:`MGPU_DIM`. Differentiable in lhs and rhs; ``interpret`` runs the
    kernels in Mosaic GPU's interpreter (any backend)."""
    return checked_call("mgpu", mgpu_unsupported, _mgpu_impl(interpret), lhs, rhs, sizes)
