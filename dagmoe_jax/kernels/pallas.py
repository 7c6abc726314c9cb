"""JAX's own Pallas TPU kernels, wrapped for this model's layouts.

* :func:`splash_causal_attention`: causal grouped-query attention by the splash ("sparse
  flash") kernel of ``jax.experimental.pallas.ops.tpu.splash_attention`` (MaxText's TPU
  attention): blocks above the diagonal are skipped, the softmax is online, and the G query
  heads of a KV head share its keys and values (``make_splash_mha`` with KV < H heads).
  ``ExecutionConfig.attention='splash'``.
* :func:`gmm_grouped_matmul`: the grouped matmul of dropless dispatch by megablox ``gmm``
  (``jax.experimental.pallas.ops.tpu.megablox``, with its custom VJP: ``gmm`` for the input
  gradient, ``tgmm`` for the weights'). ``ExecutionConfig.grouped_matmul='gmm'``.

Both lower only for TPU (Mosaic); with ``interpret=True`` they run anywhere through the Pallas
interpreter (slow, exact), which is how the CPU test suite checks their numerics against the
reference attention and ``jax.lax.ragged_dot``. Which kernel a model uses is settled once by
:func:`dagmoe_jax.model.settle.settle`; these functions never ask which machine they run on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.megablox.ops import gmm as megablox_gmm

SPLASH_BLOCK = 128
"""Query and key block of the splash kernel: its key blocks must be multiples of the TPU's 128
lanes, so sequences must be too (:func:`splash_supported`)."""

GMM_TILE = (128, 128, 128)
"""(rows, contracted, output) tile of megablox ``gmm``; each is capped at the problem's size.
Its backward pass reuses the tile with the contracted and output dimensions swapped, so on TPU
both (d_model and the expert hidden size) must be multiples of 128 (:func:`gmm_supported`)."""


def splash_supported(seq_len: int) -> bool:
    """Whether the splash kernel takes a sequence of ``seq_len`` positions (a multiple of
    :data:`SPLASH_BLOCK`); shorter or ragged ones (a sampling prompt) use XLA's attention."""
    return seq_len % SPLASH_BLOCK == 0


def _splash_kernel(num_heads: int, seq_len: int, interpret: bool):
    """The splash kernel for causal attention of ``num_heads`` heads over ``seq_len``
    positions. Its block-sparsity metadata is built here in NumPy, once per trace: it is not
    cached across traces, since arrays made in one trace would enter the next as captured
    constants (which ``jax.export`` refuses)."""
    mask = splash.MultiHeadMask([splash.CausalMask((seq_len, seq_len))] * num_heads)
    b = SPLASH_BLOCK
    blocks = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                               block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                               block_kv_dq=b)
    return splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def splash_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                            segment_ids: jax.Array | None = None,
                            interpret: bool = False) -> jax.Array:
    """Causal attention of q [B, S, H, D] over k, v [B, S, KV, D] (H a multiple of KV) by the
    splash kernel; S a multiple of :data:`SPLASH_BLOCK`. Equals
    :func:`~dagmoe_jax.model.attention.causal_attention_reference` (tests/test_pallas.py).

    The kernel takes one sequence in the heads-major layout [H, S, D] and does not scale the
    scores, so queries are scaled by 1 / sqrt(D) first and the batch is a ``vmap``.
    ``segment_ids`` int32 [B, S] (packed examples): the kernel's own ``SegmentIds`` (the same
    ids for queries and keys), which it combines with the causal mask: query i sees key j only
    when both hold the same id.
    """
    b, s, h, d = q.shape
    if not splash_supported(s):
        raise ValueError(f"splash attention needs a sequence length that is a multiple of "
                         f"{SPLASH_BLOCK}, got {s}: use attention='xla' for this shape")
    kernel = _splash_kernel(h, s, interpret)
    heads_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    args = (heads_major(q * (1.0 / float(d) ** 0.5)).astype(q.dtype), heads_major(k),
            heads_major(v))
    if segment_ids is None:
        out = jax.vmap(kernel)(*args)
    else:
        segmented = lambda q, k, v, seg: kernel(  # noqa: E731
            q, k, v, segment_ids=splash.SegmentIds(q=seg, kv=seg))
        out = jax.vmap(segmented)(*args, jnp.asarray(segment_ids, jnp.int32))
    return heads_major(out).astype(q.dtype)


def gmm_supported(d_model: int, hidden: int) -> bool:
    """Whether megablox ``gmm`` lowers for TPU with experts of ``d_model`` x ``hidden``: both
    multiples of the 128-lane tile (Mosaic's blocks are multiples of 128 or the whole axis)."""
    return d_model % GMM_TILE[1] == 0 and hidden % GMM_TILE[2] == 0


def gmm_grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, *,
                       zero_tail: bool = True, interpret: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, sizes)`` by megablox ``gmm``: rows of ``lhs`` [M, k]
    sorted by group, group g's ``sizes[g]`` rows times ``rhs[g]`` [k, n]; rows past
    ``sum(sizes)`` give zeros. Groups may be empty and of any size: ``gmm`` tiles rows across
    group boundaries; M is padded to a multiple of its row tile here.

    ``zero_tail=False``: the caller has no rows past the groups (local dropless dispatch,
    ``sum(sizes) == M``) or never reads them nor lets their gradients reach what it reads (the
    exchange's receive buffer): they are left as ``gmm`` leaves them, unwritten, and the two
    selects that zero them, each a pass over all M rows forward and again backward, are left
    out. ``gmm``'s weight gradient masks rows outside the groups by a select of its own, so
    whatever they hold never reaches it; the row tile's padding is cut off either way."""
    m, k = lhs.shape
    n = rhs.shape[2]
    tm = min(GMM_TILE[0], -(-m // 8) * 8)            # a multiple of the 8 sublanes
    tiling = (tm, min(GMM_TILE[1], k), min(GMM_TILE[2], n))
    padded = jnp.pad(lhs, ((0, -m % tm), (0, 0)))
    if zero_tail:
        # gmm leaves rows outside every group unwritten, in its output and in its input
        # gradient: both are zeroed here, as ragged_dot has them
        valid = (jnp.arange(m + (-m % tm)) < jnp.sum(sizes))[:, None]
        padded = jnp.where(valid, padded, 0)
    out = megablox_gmm(padded, rhs, sizes.astype(jnp.int32), lhs.dtype, tiling, None, None,
                       False, interpret)
    if zero_tail:
        out = jnp.where(valid, out, 0)
    return out[:m].astype(lhs.dtype)
