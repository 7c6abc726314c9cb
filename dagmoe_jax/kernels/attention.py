"""Fused causal grouped-query attention for XLA:CPU (C++ source: ``causal_attention.cc``).

Exact softmax attention, the same function as
:func:`dagmoe_jax.model.attention.causal_attention_reference`, computed one query row at a
time so that no S x S score matrix is ever materialised: the forward pass saves only each
row's log-sum-exp, and the backward pass recomputes the probabilities from it
(FlashAttention's recipe, Dao et al. 2022, Algorithm 2, with a row instead of a tile). On the
2-core CPU this is what lets the MoE-s training step beat XLA's blockwise attention, whose
time at head_dim 16 goes to memory passes over its score blocks. Packed examples (segment ids,
docs/design.md section 1) run through a second pair of entry points with one more input; the
plain pair is the same code as before.

float32 only, head_dim in :data:`SUPPORTED_HEAD_DIMS`, CPU only; the kernel is compiled on
first use (:mod:`dagmoe_jax.kernels.build`), and :func:`fused_attention_unavailable` says why
it cannot be used where it cannot.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp

from dagmoe_jax.kernels.build import compiler, is_built, load_ffi_targets

SOURCE = Path(__file__).with_name("causal_attention.cc")
SUPPORTED_HEAD_DIMS = (8, 16, 32, 64, 128, 256)
_FWD = "dagmoe_causal_attention_fwd"
_BWD = "dagmoe_causal_attention_bwd"
_SEG_FWD = "dagmoe_causal_attention_segmented_fwd"
_SEG_BWD = "dagmoe_causal_attention_segmented_bwd"


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
    """Build and register the kernel once per process; None on success, else the reason."""
    return load_ffi_targets(SOURCE, {_FWD: "DagmoeCausalAttentionFwd",
                                     _BWD: "DagmoeCausalAttentionBwd",
                                     _SEG_FWD: "DagmoeCausalAttentionSegmentedFwd",
                                     _SEG_BWD: "DagmoeCausalAttentionSegmentedBwd"})


def kernel_needs_build() -> bool:
    """Whether using the kernel would compile it first (a compiler is there and the on-disk
    cache has no library for this source, compiler, jaxlib and CPU)."""
    return compiler() is not None and not is_built(SOURCE)


def fused_attention_unavailable(q_shape=None, dtype=jnp.float32,
                                backend: Optional[str] = None) -> Optional[str]:
    """Why the fused kernel cannot run these inputs (None when it can).

    ``q_shape`` [B, S, H, D] (only D is checked), ``dtype`` the compute dtype, ``backend`` the
    JAX backend (default: the default backend). Compiles the kernel on the first call.
    """
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return f"the fused attention kernel runs on CPU only (backend is {backend})"
    if jnp.dtype(dtype) != jnp.float32:
        return f"the fused attention kernel takes float32 only (got {jnp.dtype(dtype).name})"
    if q_shape is not None and q_shape[-1] not in SUPPORTED_HEAD_DIMS:
        return (f"the fused attention kernel supports head_dim in {SUPPORTED_HEAD_DIMS} "
                f"(got {q_shape[-1]})")
    return _load()


def _forward(q, k, v, *segments):
    """The forward custom call (output and log-sum-exp), after :func:`_check` (which also
    builds and registers the kernel on first use); ``segments``: () or (segment ids [B, S],)
    for the segmented entry point."""
    _check(q, k, v)
    b, s, h, _ = q.shape
    return jax.ffi.ffi_call(
        _SEG_FWD if segments else _FWD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                         jax.ShapeDtypeStruct((b, h, s), jnp.float32)),
        vmap_method="sequential")(q, k, v, *segments)


def fused_causal_attention(q, k, v, segment_ids=None):
    """Causal softmax attention, q [B, S, H, D], k and v [B, S, KV, D] float32 -> [B, S, H, D].

    H must be a multiple of KV (grouped-query attention); scores are scaled by 1 / sqrt(D).
    ``segment_ids`` int [B, S] (packed examples, docs/design.md section 1): query i sees key j
    only when both hold the same id, by the kernel's segmented entry points (each row skips
    the key tiles before its segment); None runs the plain kernel, unchanged. Differentiable in
    q, k, v (the segment ids get no gradient). Raises ValueError with the reason when the
    kernel cannot run (see :func:`fused_attention_unavailable`).
    """
    if segment_ids is None:
        return _plain(q, k, v)
    if tuple(segment_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, expected "
                         f"{tuple(q.shape[:2])} (the queries' [B, S])")
    return _segmented(q, k, v, jnp.asarray(segment_ids).astype(jnp.int32))


@jax.custom_vjp
def _plain(q, k, v):
    return _forward(q, k, v)[0]


@jax.custom_vjp
def _segmented(q, k, v, segment_ids):
    return _forward(q, k, v, segment_ids)[0]


def _check(q, k, v):
    reason = fused_attention_unavailable(q.shape, q.dtype)
    if reason is None and not (k.dtype == v.dtype == jnp.float32):
        reason = "the fused attention kernel takes float32 only (k or v is not)"
    if reason is not None:
        raise ValueError(f"{reason}; use ExecutionConfig.attention='blockwise' instead")


def _fwd(q, k, v, *segments):
    out, lse = _forward(q, k, v, *segments)
    return out, (q, k, v, segments, out, lse)


def _bwd(res, dout):
    q, k, v, segments, out, lse = res
    grads = tuple(jax.ffi.ffi_call(
        _SEG_BWD if segments else _BWD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                         jax.ShapeDtypeStruct(k.shape, jnp.float32),
                                         jax.ShapeDtypeStruct(v.shape, jnp.float32)),
        vmap_method="sequential")(q, k, v, *segments, out, lse, dout.astype(jnp.float32)))
    return grads + (None,) * len(segments)           # integer segment ids: no cotangent


_plain.defvjp(_fwd, _bwd)
_segmented.defvjp(_fwd, _bwd)
