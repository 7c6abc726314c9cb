"""DoE's sparse reading of the experts (``DoEConfig.expert='blocks'``; docs/design.md section 6).

Each knowledge block k owns a slice of the block's FFN, a SwiGLU ``FFN_k: d -> h_b -> d``
(``DoEConfig.block_hidden``), and the block output is ``sum_k G_k FFN_k(H_enr)`` over the blocks
a token activates: its Top-N gates (``DoEConfig.top_n``; 0 = all K) that are not zero. This is
the reading under which the paper's active-parameter count (3B of 7B, sec. 4.5), Table 13's
Top-N column and the gradient isolation of Appendix I.3 (a zero gate gives its block zero
gradient) hold; the default reading (``expert='composed'``, ``e = G^T Z`` into one dense FFN)
keeps every FFN weight active.

Inactive blocks cost nothing: the (token, block) pairs are sorted by block and run through the
grouped matmul of dropless MoE dispatch (:func:`dagmoe_jax.model.routed.dispatch.dropless_dispatch`);
a pair whose gate is zero gets the out-of-range id K, so it sorts past every group and its row is
neither computed (``ragged_dot`` / ``gmm`` skip rows past ``sum(sizes)``) nor differentiated.
:func:`masked_dense_blocks` is the reference: every block on every token, gates outside the
Top-N masked to zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.model.routed.dispatch import dropless_dispatch


def block_hidden(cfg: ModelConfig) -> int:
    """h_b, the hidden width of one knowledge block's FFN slice: ``DoEConfig.block_hidden``, or
    the dense FFN's hidden width (``ffn_hidden`` or the model's) split into K slices."""
    c = cfg.block
    if c.block_hidden is not None:
        return c.block_hidden
    return max(1, cfg.resolved_ffn_hidden // c.num_topics)


def active_blocks(cfg: ModelConfig) -> int:
    """N, the most knowledge blocks one token runs (``top_n``, 0 meaning all K)."""
    return cfg.block.top_n or cfg.block.num_topics


def select_blocks(gates: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """DoE Table 13's Top-N with the ReLU gates' zeros skipped: (ids [T, N], gates [T, N]) of
    each token's N largest gates [T, K], an id set to K (skipped) where its gate is not > 0."""
    top, ids = jax.lax.top_k(gates, n)
    return jnp.where(top > 0, ids, gates.shape[-1]), top


def sparse_blocks(x: jax.Array, gates: jax.Array, weights, n: int,
                  grouped_matmul: str = "ragged_dot") -> tuple[jax.Array, jax.Array]:
    """The sparse expert ``sum_{k in TopN, G_k > 0} G_k FFN_k(x)`` of tokens x [T, d] with gates
    [T, K] and the blocks' SwiGLU weights (gate [K, d, h_b], up [K, d, h_b], down [K, h_b, d]),
    by dropless grouped matmuls over the active (token, block) pairs only (``grouped_matmul``:
    a settled ``ExecutionConfig.grouped_matmul``, e.g. 'cpu_gmm' on CPU).
    Returns (out [T, d], ids [T, N]: the blocks run, K where skipped)."""
    ids, top = select_blocks(gates, n)
    y, _ = dropless_dispatch(x, ids, weights, grouped_matmul)           # [T, N, d]
    out = jnp.einsum("tn,tnd->td", top.astype(jnp.float32), y.astype(jnp.float32))
    return out.astype(x.dtype), ids


def masked_dense_blocks(x: jax.Array, gates: jax.Array, weights, n: int) -> jax.Array:
    """Reference of :func:`sparse_blocks`: every block's FFN on every token, weighted by the
    gates with those outside each token's Top-N set to zero (K times the work)."""
    w_gate, w_up, w_down = weights
    h = jax.nn.silu(jnp.einsum("td,kdh->tkh", x, w_gate)) * jnp.einsum("td,kdh->tkh", x, w_up)
    y = jnp.einsum("tkh,khd->tkd", h, w_down)                           # [T, K, d]
    top, ids = jax.lax.top_k(gates, n)
    mask = jnp.zeros_like(gates).at[jnp.arange(gates.shape[0])[:, None], ids].set(1.0)
    return jnp.einsum("tk,tkd->td", gates * mask, y)
