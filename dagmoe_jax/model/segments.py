"""Packed sequences: several examples in one row, told apart by segment ids (docs/design.md
section 1).

``segment_ids`` int32 [B, S]: equal nonzero ids mark one example, 0 marks padding. Examples are
contiguous runs of positions, as a packer lays them out. Attention lets token i see token j
only when ``j <= i`` and ``segment_ids[i] == segment_ids[j]`` (:func:`segment_mask`; padding
tokens see the padding before them, so no row of scores is empty and nothing is NaN), and RoPE
positions restart at 0 at each example's first token (:func:`segment_positions`), so a packed
example computes what it would alone in its own row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """RoPE positions of packed examples: int32 [B, S], ``index - (index of the first token of
    its segment)``, a segment's first token being where the id differs from the one before
    (position 0 of the row always starts one).

    ``segment_ids`` [B, S] int; a pure function (a running maximum of the segment starts), so
    it runs inside the jitted forward pass. A row of one segment gets 0..S-1, the positions
    without segment ids.
    """
    seg = jnp.asarray(segment_ids)
    s = seg.shape[-1]
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), seg.shape)
    first = jnp.concatenate([jnp.ones_like(seg[..., :1], bool), seg[..., 1:] != seg[..., :-1]],
                            axis=-1)
    start = jax.lax.cummax(jnp.where(first, index, 0), axis=seg.ndim - 1)
    return index - start


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool [B, S, S]: query i sees key j when ``j <= i`` and both hold the same segment id
    (causal attention within each packed example)."""
    seg = jnp.asarray(segment_ids)
    s = seg.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    return causal & (seg[..., :, None] == seg[..., None, :])


def check_segment_ids(segment_ids: jax.Array, shape) -> jax.Array:
    """``segment_ids`` as int32, after checking it has the tokens' ``shape`` [B, S] (a
    one-line ValueError otherwise)."""
    if tuple(segment_ids.shape) != tuple(shape):
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, the tokens "
                         f"{tuple(shape)}: pass one segment id per token")
    return jnp.asarray(segment_ids).astype(jnp.int32)
