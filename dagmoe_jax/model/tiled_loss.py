"""Cross-entropy through the LM head without the [tokens, vocab] logits (vocabulary-tiled loss).

At Llama-3's 128,256-token vocabulary the float32 logits of a batch are the largest tensor of
a training step (``4 B S V`` bytes, and autodiff keeps the softmax and the logits'
cotangent beside them). :func:`tiled_cross_entropy` takes the final-normed hidden states
instead (``Transformer(..., head=False)``) and the LM head's weight, and runs head and softmax
a chunk of positions at a time inside a ``lax.scan``, so only one chunk's logits
[B, chunk, V] ever exist.

Its custom VJP computes the gradients in the same pass as the loss ("gradient in the forward",
as Liger's fused linear cross-entropy does): the loss is a sum, so its cotangent is one scalar,
and for each chunk

    dlogits = w_t (softmax(logits_t) - onehot(target_t)),
    dh_t = dlogits W^T,   dW += h^T dlogits

are known once the chunk's logits are. The backward pass only scales the saved dh and dW by
that scalar: the LM head's three matmuls (logits, dh, dW) are done once each, as autodiff of
the plain loss does, with no recomputation of the logits. Evaluation without gradients runs the
primal only (the loss, one matmul per chunk).

On a mesh whose batch axes shard the rows (and which leaves the vocabulary whole), the chunks
run inside a ``shard_map`` over those axes (:func:`_per_device`): each device takes the LM
head once, scans its own rows, and sums its dW over its chunks locally, so the batch's dW is
summed across devices once, after the scan. Left to the partitioner, the scan's dW carry,
sharded as the head is, made it all-gather the head and all-reduce a whole [d, V] float32 dW
in every chunk. The price is memory: while the scan runs each device holds a whole float32
dW (``4 d V`` bytes) where the sharded carry held 1 / fsdp of it (benchmarks/RESULTS.md,
"Memory of the vocabulary-tiled loss", has both sides' figures).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dagmoe_jax.parallel import constrain
from dagmoe_jax.parallel.state import (active_axes_size, active_batch_shards, active_mesh_axes,
                                       active_row_axes)

DEFAULT_CHUNK_TOKENS = 512
"""Tokens (batch rows x positions) per chunk: 512 x 128,256 float32 logits are 263 MB, and a
[512, d] x [d, V] matmul is still large enough to run at the machine's matmul rate."""


def chunk_positions(batch: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Positions per chunk so that a chunk of all ``batch`` rows holds about ``chunk_tokens``."""
    return max(1, chunk_tokens // batch)


def _chunks(x: jax.Array, c: int) -> jax.Array:
    """[B, S, ...] -> [S / c, B, c, ...]: the scanned chunk axis first, rows kept (so a batch
    sharding of the rows carries over to every chunk)."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // c, c, *x.shape[2:]), 1, 0)


def _scan(h, w, targets, weights, c: int, with_grads: bool, manual: tuple = ()):
    """The loss sum_t w_t (logsumexp(h_t W) - (h_t W)[target_t]) over chunks of ``c``
    positions, and with ``with_grads`` its gradients dh [B, S, d] and dW [d, V] (float32).
    In the global view the logits and the dW carry are held to their logical shardings;
    ``manual``: the mesh axes of the ``shard_map`` it runs in (:func:`_per_device`), over which
    this device's dW differs from the others'."""
    d, v = w.shape
    keep = constrain if not manual else (lambda x, _names: x)

    def body(dw, xs):
        hc, tc, wc = xs                                               # [B,c,d], [B,c], [B,c]
        rows = hc.reshape(-1, d)       # 2-D matmuls: XLA:CPU runs rank-3 weight gradients slowly
        logits = jnp.dot(rows, w, preferred_element_type=jnp.float32).reshape(*tc.shape, v)
        logits = keep(logits, ("batch", "length", "vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
        loss = jnp.sum(wc * (lse - picked))
        if not with_grads:
            return dw, (loss, None)
        onehot = jax.nn.one_hot(tc, v, dtype=jnp.float32)
        dlogits = ((jnp.exp(logits - lse[..., None]) - onehot) * wc[..., None]).astype(w.dtype)
        dlogits = dlogits.reshape(-1, v)
        dh = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32).reshape(hc.shape)
        dw = dw + jnp.dot(rows.T, dlogits, preferred_element_type=jnp.float32)
        return keep(dw, ("embed", "vocab")), (loss, dh.astype(hc.dtype))

    dw0 = jnp.zeros((d, v), jnp.float32) if with_grads else None
    if with_grads and manual:
        dw0 = jax.lax.pcast(dw0, manual, to="varying")
    xs = (_chunks(h, c), _chunks(targets, c), _chunks(weights, c))
    dw, (losses, dh) = jax.lax.scan(body, dw0, xs)
    if not with_grads:
        return jnp.sum(losses), None, None
    b, s = targets.shape
    dh = jnp.moveaxis(dh, 0, 1).reshape(b, s, d)
    return jnp.sum(losses), dh, dw


def _head_shards(axes: tuple, d: int) -> tuple:
    """The row axes ``axes`` that shard the LM head's ``embed`` dimension (of size ``d``),
    when all of them do: over those dW is reduce-scattered straight to the head's own
    sharding, over the rest all-reduced. () where no row axis shards it, or another does."""
    split = active_mesh_axes("embed")
    if not split or not set(split) <= set(axes) or d % active_axes_size(split):
        return ()
    return split


def _per_device(h, w, targets, weights, c: int, with_grads: bool):
    """:func:`_scan` with each device scanning its own rows (this module's docstring): the
    head taken whole once, the loss and dW summed across the batch axes after the scan, dW
    in the head's dtype (as the partitioner sums every other weight's gradient) and
    reduce-scattered to the head's sharding over the axes that shard it (:func:`_head_shards`:
    half an all-reduce's traffic), all-reduced over the others. The global view where the
    batch axes do not split the rows, or
    where the rules split the vocabulary (over ``tensor``: the global view splits the head's
    matmuls; :func:`~dagmoe_jax.parallel.state.active_row_axes`)."""
    axes = active_row_axes(h.shape[0], whole=("vocab",))
    if axes is None:
        return _scan(h, w, targets, weights, c, with_grads)
    rows = P(axes)
    scatter = _head_shards(axes, w.shape[0])
    rest = tuple(a for a in axes if a not in scatter)

    def local(h, w, targets, weights):
        loss, dh, dw = _scan(h, w, targets, weights, c, with_grads, manual=axes)
        loss = jax.lax.psum(loss, axes)
        if not with_grads:
            return (loss,)
        dw = dw.astype(w.dtype)
        if scatter:
            dw = jax.lax.psum_scatter(dw, scatter, scatter_dimension=0, tiled=True)
        return loss, dh, jax.lax.psum(dw, rest) if rest else dw

    out_specs = (P(),) if not with_grads else (P(), rows, P(scatter or None, None))
    out = jax.shard_map(local, in_specs=(rows, P(), rows, rows), out_specs=out_specs)(
        h, w, targets, weights)
    return out if with_grads else (out[0], None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tiled(h, w, targets, weights, c):
    return _per_device(h, w, targets, weights, c, with_grads=False)[0]


def _tiled_fwd(h, w, targets, weights, c):
    loss, dh, dw = _per_device(h, w, targets, weights, c, with_grads=True)
    return loss, (dh, dw.astype(w.dtype))


def _tiled_bwd(_c, saved, g):
    dh, dw = saved
    return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_cross_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array,
                        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                        tokens: Optional[jax.Array] = None) -> jax.Array:
    """Mean token cross-entropy of the logits ``h @ w`` over positions where ``mask`` is true,
    computed a chunk of positions at a time (this module's docstring). ``tokens``: the count
    the summed cross-entropy is divided by (default: the mask's; a micro-batch of gradient
    accumulation passes its share of the whole batch's, so every token weighs the same).

    h [B, S, d]: final-normed hidden states (``Transformer(tokens, head=False)``); w [d, V]: the
    LM head, in ``h``'s dtype (the products accumulate in float32, as the model's head does);
    targets [B, S] int; mask [B, S]. Equals ``step.cross_entropy(h @ w, targets, mask)``, and
    so do its gradients with respect to ``h`` and ``w``, to float32 rounding. Positions are
    padded to a multiple of the chunk with zero weight.
    """
    b, s, _ = h.shape
    mask = mask.astype(jnp.float32)
    weights = mask / (jnp.maximum(jnp.sum(mask), 1.0) if tokens is None else tokens)
    c = min(chunk_positions(b, chunk_tokens), s)
    pad = -s % c
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        weights = jnp.pad(weights, ((0, 0), (0, pad)))
    return _tiled(h, w, targets.astype(jnp.int32), jax.lax.stop_gradient(weights), c)


def tiled_scores(h: jax.Array, w: jax.Array, targets: jax.Array,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple:
    """Per-position cross-entropy [B, S] (float32) and argmax prediction [B, S] (int32) of the
    logits ``h @ w``, a chunk of positions at a time: what evaluation needs, without the
    [B, S, V] logits (at a 128K vocabulary more than the tiled training step's own transient
    memory). Equal to
    ``optax.softmax_cross_entropy_with_integer_labels(h @ w, targets)`` and
    ``argmax(h @ w, -1)`` (ties to the lowest id, as ``jnp.argmax``)."""
    b, s, d = h.shape
    v = w.shape[1]
    c = min(chunk_positions(b, chunk_tokens), s)
    pad = -s % c
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))

    def chunk(xs):
        hc, tc = xs                                                   # [B, c, d], [B, c]
        logits = jnp.dot(hc.reshape(-1, d), w, preferred_element_type=jnp.float32)
        logits = constrain(logits.reshape(*tc.shape, v), ("batch", "length", "vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
        return lse - picked, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    losses, predictions = jax.lax.map(chunk, (_chunks(h, c), _chunks(targets.astype(jnp.int32),
                                                                        c)))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, s + pad)[:, :s]  # noqa: E731
    return unchunk(losses), unchunk(predictions)


def chunk_tokens(execution) -> int:
    """Tokens of the whole batch in one chunk of a model's tiled loss: the per-device
    ``loss_chunk`` of the model's settled ``execution`` (512 while unsettled) times the
    batch's shards on the active mesh, since the loss sees the global batch."""
    return (execution.loss_chunk or DEFAULT_CHUNK_TOKENS) * active_batch_shards()
