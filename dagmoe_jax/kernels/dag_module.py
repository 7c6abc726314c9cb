"""The DAG module's elementwise work for XLA:CPU (C++ source: ``dag_module.cc``).

Two functions of :mod:`dagmoe_jax.families.moe.dag.equations`, each tied to its gradient by a custom VJP,
for ``ExecutionConfig.dag_module='fused'``:

* :func:`fused_dag_messages`, the pairwise half of ``dag_messages`` (DAG-MoE eq. 9-10, summed
  over the senders as eq. 11 needs): from the nodes' projections ``proj`` [T, K, 4 d_g] =
  [e_i | n_i | e_j | n_j] it returns m_i = sum_{j in senders(i)} act(e_i + e_j) * (n_i + n_j)
  [T, K, d_g]. XLA builds the K x K pair tensor [T, K, K, d_g] for this and keeps the edge
  gates for the backward pass: at the s model's shape 8.4M floats per tensor per layer and
  iteration, passed over several times. The kernel never builds it: the forward pass keeps
  one accumulator per node, the backward pass recomputes each pair's gate from ``proj``.
* :func:`fused_layer_norm`, eq. 7's ``layer_norm`` in float32: XLA:CPU runs its row reductions
  inside YNNPACK fusions, at a third of this kernel's speed; the backward pass recomputes the
  normalised rows from the saved mean and 1 / std.

The module's projections (eq. 8, 9 and 11) use :func:`~dagmoe_jax.kernels.grouped_matmul.
cpu_dense_matmul` on the same path, for their weight gradients; so 'fused' needs that kernel too.

float32, d_g and d multiples of 16, CPU only; compiled on first use by
:mod:`dagmoe_jax.kernels.build` like the other CPU kernels, and
:func:`dag_module_unavailable` says why it cannot be used where it cannot.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dagmoe_jax.kernels.build import compiler, is_built, load_ffi_targets
from dagmoe_jax.kernels.grouped_matmul import grouped_matmul_unavailable

SOURCE = Path(__file__).with_name("dag_module.cc")
_TARGETS = {"dagmoe_dag_messages": "DagmoeDagMessages",
            "dagmoe_dag_messages_bwd": "DagmoeDagMessagesBwd",
            "dagmoe_layer_norm": "DagmoeLayerNorm",
            "dagmoe_layer_norm_bwd": "DagmoeLayerNormBwd"}
EDGES = {"all": 0, "ranked": 1, "self": 2}      # the messages kernel's ``edges`` attribute
ACTIVATIONS = {"silu": 0, "sigmoid": 1}          # its ``act`` attribute
LAYER_NORM_ROWS = 64       # rows per block of the LayerNorm's dparams: dag_module.cc's kRows


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
    """Build and register the kernels once per process; None on success, else the reason."""
    return load_ffi_targets(SOURCE, _TARGETS)


def dag_module_needs_build() -> bool:
    """Whether using the kernels would compile them first (a compiler is there and the on-disk
    cache has no library for this source, compiler, jaxlib and CPU)."""
    return compiler() is not None and not is_built(SOURCE)


def dag_module_unavailable(d_model: Optional[int] = None, dag_dim: Optional[int] = None,
                           dtype=jnp.float32, backend: Optional[str] = None) -> Optional[str]:
    """Why the kernels cannot run a DAG module of width ``d_model`` and ``dag_dim`` in ``dtype``
    on ``backend`` (default: JAX's default backend); None when they can. Compiles the kernels
    on the first call."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return f"the DAG module kernels run on CPU only (backend is {backend})"
    if jnp.dtype(dtype) != jnp.float32:
        return f"the DAG module kernels take float32 only (got {jnp.dtype(dtype).name})"
    for name, width in (("d_model", d_model), ("d_g", dag_dim)):
        if width is not None and width % 16:
            return f"the DAG module kernels take {name} a multiple of 16 (got {width})"
    return _load() or grouped_matmul_unavailable(backend)   # cpu_dense_matmul's kernel too


def _check(width_name: str, width: int, dtype) -> None:
    reason = dag_module_unavailable(**{width_name: width}, dtype=dtype)
    if reason is not None:
        raise ValueError(f"{reason}; use ExecutionConfig.dag_module='xla' instead")


def _call(target: str, shapes, *args, **attrs):
    out = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args, **attrs)


def fused_dag_messages(proj: jax.Array, edges: str = "all", edge_act: str = "silu") -> jax.Array:
    """m_i = sum_j act(e_i + e_j) * (n_i + n_j) [T, K, d_g] from ``proj`` [T, K, 4 d_g]
    = [e_i | n_i | e_j | n_j] by the C++ kernel, over the senders of ``edges`` ('all',
    'ranked': j <= i, 'self': j = i) with ``edge_act`` 'silu' or 'sigmoid'. Differentiable in
    ``proj``; operands the kernel cannot take are a one-line ``ValueError``."""
    if proj.ndim != 3 or proj.shape[-1] % 4:
        raise ValueError(f"DAG messages: expected proj [T, K, 4 d_g], got {tuple(proj.shape)}")
    _check("dag_dim", proj.shape[-1] // 4, proj.dtype)
    return _messages(proj, EDGES[edges], ACTIVATIONS[edge_act])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _messages(proj, edges: int, act: int):
    t, k, width = proj.shape
    return _call("dagmoe_dag_messages", [(t, k, width // 4)], proj, edges=np.int64(edges),
                 act=np.int64(act))[0]


def _messages_fwd(proj, edges, act):
    return _messages(proj, edges, act), proj


def _messages_bwd(edges, act, proj, dmsg):
    return tuple(_call("dagmoe_dag_messages_bwd", [proj.shape], proj, dmsg.astype(jnp.float32),
                       edges=np.int64(edges), act=np.int64(act)))


_messages.defvjp(_messages_fwd, _messages_bwd)


def fused_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """``dag.equations.layer_norm(x, scale, bias, eps)`` over the last axis of float32 ``x``
    [..., d] by the C++ kernel; differentiable in all three. Operands the kernel cannot take are
    a one-line ``ValueError``."""
    _check("d_model", x.shape[-1], x.dtype)
    return _layer_norm(x, scale.astype(jnp.float32), bias.astype(jnp.float32), float(eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, eps: float):
    return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
    y, stats = _call("dagmoe_layer_norm", [x.shape, x.shape[:-1] + (2,)], x, scale, bias,
                     eps=np.float32(eps))
    return y, (x, scale, stats)


def _layer_norm_bwd(eps, res, dy):
    del eps
    x, scale, stats = res
    rows = x.size // x.shape[-1]
    blocks = -(-rows // LAYER_NORM_ROWS)
    dx, dparams = _call("dagmoe_layer_norm_bwd", [x.shape, (blocks, 2, x.shape[-1])], x, scale,
                        stats, dy.astype(jnp.float32))
    dscale, dbias = jnp.sum(dparams, axis=0)
    return dx, dscale, dbias


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)
