"""Grouped matmul for XLA:CPU (C++ source: ``grouped_matmul.cc``), dropless dispatch's GEMMs.

The same function as ``jax.lax.ragged_dot(lhs, rhs, sizes)``: the rows of ``lhs`` [M, K] are
sorted by group, group g's ``sizes[g]`` rows are multiplied by ``rhs[g]`` [K, N], and rows past
``sum(sizes)`` give zeros. XLA:CPU lowers ``ragged_dot`` to a loop that is 40-100x slower
than a GEMM of the same FLOPs; this runs one register-blocked GEMM per group instead, in a
custom call per product: the forward pass (``lhs_g @ rhs[g]``), the input gradient
(``dy_g @ rhs[g]^T``) and the weight gradient (``lhs_g^T @ dy_g`` per group, zero for an
empty group), tied together by the custom VJP the GPU kernels share (:mod:`.grouped_vjp`).
``ExecutionConfig.grouped_matmul='cpu_gmm'``.

:func:`cpu_dense_matmul` is a dense layer ``x @ w`` whose weight gradient ``x^T dy`` runs in the
same kernel file: XLA:CPU contracts thousands of rows into a small [K, N] at 40-70% of its
matmul rate (the DAG module's projections), the kernel at 80-90% (benchmarks/grouped_matmul.py).

float32 arithmetic (bfloat16 operands are widened, the result rounded back), CPU only; the
kernel is compiled on first use by :mod:`dagmoe_jax.kernels.build`, like the attention
kernel, and :func:`grouped_matmul_unavailable` says why it cannot be used where it cannot.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp

from dagmoe_jax.kernels.build import compiler, is_built, load_ffi_targets
from dagmoe_jax.kernels.grouped_vjp import check_operands, grouped_vjp

SOURCE = Path(__file__).with_name("grouped_matmul.cc")
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
_TARGETS = {"dagmoe_gmm": "DagmoeGmm", "dagmoe_gmm_t": "DagmoeGmmT",
            "dagmoe_tgmm": "DagmoeTgmm", "dagmoe_wgrad": "DagmoeWgrad"}


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
    """Build and register the kernel once per process; None on success, else the reason."""
    return load_ffi_targets(SOURCE, _TARGETS)


def grouped_matmul_needs_build() -> bool:
    """Whether using the kernel would compile it first (a compiler is there and the on-disk
    cache has no library for this source, compiler, jaxlib and CPU)."""
    return compiler() is not None and not is_built(SOURCE)


def grouped_matmul_unavailable(backend: Optional[str] = None) -> Optional[str]:
    """Why the CPU grouped matmul cannot run on ``backend`` (default: JAX's default backend),
    None when it can. Compiles the kernel on the first call."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return f"the CPU grouped matmul runs on CPU only (backend is {backend})"
    return _load()


def _check(lhs, rhs, sizes) -> None:
    """One-line ValueError for operands the kernel cannot take."""
    check_operands("CPU", lhs, rhs, sizes)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"grouped matmul: {name} is {jnp.dtype(x.dtype).name}; the CPU "
                             f"kernel takes float32 or bfloat16")
    reason = grouped_matmul_unavailable()
    if reason is not None:
        raise ValueError(f"{reason}; use ExecutionConfig.grouped_matmul='ragged_dot' instead")


def _call(target: str, shape, *args):
    """The custom call ``target`` on float32 ``args`` (the last is int32 sizes) -> f32 ``shape``."""
    *floats, sizes = args
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, jnp.float32),
                            vmap_method="sequential")(
        *(a.astype(jnp.float32) for a in floats), sizes.astype(jnp.int32))


def cpu_grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, sizes)`` by the C++ kernel: rows of ``lhs`` [M, K]
    sorted by group, group g's ``sizes[g]`` rows times ``rhs[g]`` [K, N] -> [M, N] in the
    operands' result dtype; rows past ``sum(sizes)`` give zeros. Differentiable in ``lhs``
    and ``rhs``. ``sizes`` must be non-negative and sum to at most M (the kernel fails the
    call otherwise); an operand it cannot take is a one-line ``ValueError``."""
    _check(lhs, rhs, sizes)
    return _gmm(lhs, rhs, sizes)


def _gmm_forward(lhs, rhs, sizes):
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    return _call("dagmoe_gmm", (lhs.shape[0], rhs.shape[2]), lhs, rhs, sizes).astype(out_dtype)


def _gmm_input_grad(dy, rhs, sizes):
    return _call("dagmoe_gmm_t", (dy.shape[0], rhs.shape[1]), dy, rhs, sizes)


def _gmm_weight_grad(lhs, dy, sizes):
    return _call("dagmoe_tgmm", (sizes.shape[0], lhs.shape[1], dy.shape[1]), lhs, dy, sizes)


_gmm = grouped_vjp(_gmm_forward, _gmm_input_grad, _gmm_weight_grad)


def cpu_dense_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [T, K] @ w [K, N]``, forward and input gradient by XLA, the weight gradient
    ``x^T dy`` by the kernel (``DagmoeWgrad``: the T rows split into one range per thread,
    each swept in cache-sized blocks). The kernel computes in float32. Where the kernel
    cannot run, it is XLA's ``x @ w``."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"dense matmul: expected x [T, K] and w [K, N], got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if grouped_matmul_unavailable() is not None:
        return x @ w
    return _dense(x, w)


def cpu_weight_gradient(x: jax.Array, dy: jax.Array) -> jax.Array:
    """``x [T, K]^T @ dy [T, N]`` -> float32 [K, N] by the kernel (``DagmoeWgrad``), the weight
    gradient of :func:`cpu_dense_matmul`; operands are widened to float32."""
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"weight gradient: expected x [T, K] and dy [T, N], got "
                         f"{tuple(x.shape)} and {tuple(dy.shape)}")
    return jax.ffi.ffi_call("dagmoe_wgrad", jax.ShapeDtypeStruct((x.shape[1], dy.shape[1]),
                                                                 jnp.float32),
                            vmap_method="sequential")(x.astype(jnp.float32),
                                                      dy.astype(jnp.float32))


@jax.custom_vjp
def _dense(x, w):
    return x @ w


def _dense_fwd(x, w):
    return _dense(x, w), (x, w)


def _dense_bwd(res, dy):
    x, w = res
    return (dy @ w.T).astype(x.dtype), cpu_weight_gradient(x, dy).astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)
