"""Causal attention on NVIDIA GPUs by JAX's Pallas Triton flash attention
(``jax.experimental.pallas.ops.gpu.attention.mha``, its own custom VJP with Triton backward
kernels), wrapped for this model's grouped-query layout: ``ExecutionConfig.attention='triton'``.

cuDNN's flash attention ('cudnn') is what 'auto' settles to on a GPU; this is the flash kernel
that needs no cuDNN: for a GPU whose cuDNN is older than JAX's fused attention takes, and for
compiling a GPU step on a host without one (``dagmoe-compile --topology h100`` compiles it in
cuDNN's place, which cannot be compiled without the library). It runs anywhere in the Pallas
interpreter (``interpret=True``), which is how the CPU tests check it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TRITON_ATTENTION_BLOCK = 128
"""Query and key block of the forward kernel: sequences must be multiples of it
(:func:`triton_attention_supported`); the backward kernels' blocks (32) divide it."""


def triton_attention_supported(seq_len: int) -> bool:
    """Whether the Triton flash kernel takes a sequence of ``seq_len`` positions (a multiple of
    :data:`TRITON_ATTENTION_BLOCK`); other lengths (a sampling prompt) use XLA's attention."""
    return seq_len % TRITON_ATTENTION_BLOCK == 0


def triton_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                            segment_ids: jax.Array | None = None,
                            interpret: bool = False) -> jax.Array:
    """Causal attention of q [B, S, H, D] over k, v [B, S, KV, D] (H a multiple of KV) by the
    Pallas Triton flash kernel; S a multiple of :data:`TRITON_ATTENTION_BLOCK`. Equals
    :func:`~dagmoe_jax.model.attention.causal_attention_reference` (tests/test_gpu_attention.py).

    The kernel takes as many key heads as query heads, so each KV head is repeated for its G
    query heads; ``segment_ids`` int32 [B, S] (packed examples) are the kernel's own (query i
    sees key j only when both hold the same id, and j <= i)."""
    from jax.experimental.pallas.ops.gpu import attention as triton_attention
    b, s, h, d = q.shape
    if not triton_attention_supported(s):
        raise ValueError(f"Triton flash attention needs a sequence length that is a multiple "
                         f"of {TRITON_ATTENTION_BLOCK}, got {s}: use attention='xla' for it")
    groups = h // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    blocks = triton_attention.BlockSizes(
        block_q=TRITON_ATTENTION_BLOCK, block_k=TRITON_ATTENTION_BLOCK, block_q_dkv=32,
        block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    out = triton_attention.mha(q, k, v, seg, sm_scale=1.0 / float(d) ** 0.5, causal=True,
                               block_sizes=blocks, interpret=interpret)
    return out.astype(q.dtype)
