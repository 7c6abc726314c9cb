"""Multi-token prediction (DeepSeek-V3 sec. 2.2; ``ModelConfig.mtp``).

Module k (k = 1..D) of a sequence t_1..t_T combines the previous depth's hidden state of
position i with the embedding of the token k ahead (eq. 21),

    h'_i^k = M_k [RMSNorm(h_i^{k-1}); RMSNorm(Emb(t_{i+k}))],

runs one layer of the model's block family over them (eq. 22, causal as the model), and
predicts t_{i+k+1} with the shared LM head after its own final norm (eq. 23); the loss is the
mean cross-entropy of each depth's predictions, L_MTP = lambda / D sum_k L_MTP^k (eq. 24-25).
h^0 is the model's final-normed hidden state, what the released V3 modules are run on by
vLLM and SGLang; M_k is stored [2d, d] with the embedding's rows first, the layout of V3's
``eh_proj`` (the paper writes the concatenation the other way round: the same computation).

With fixed shapes: at depth k every position keeps its place, the token ahead is the batch's
``targets`` shifted k - 1 to the left and the target shifted k; the last k positions, and any
whose target lies in another packed example, are masked out of the loss (causal attention
never lets a counted position see them).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.model.layers import RMSNorm, dtype_of, make_param, normal


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
    """``x`` [B, S, ...] moved ``k`` positions to the left along axis 1, ``fill`` after."""
    if k == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, k)
    return jnp.pad(x[:, k:], pad, constant_values=fill)


def depth_targets(targets: jax.Array, mask: jax.Array, segment_ids: Optional[jax.Array],
                  k: int) -> Tuple[jax.Array, jax.Array]:
    """(tokens to predict, trained mask) at depth ``k``: position i predicts ``targets[i + k]``
    (t_{i+k+1}), counted where it exists, is trained, and belongs to position i's example."""
    ahead = shift_left(mask.astype(bool), k, False)
    if segment_ids is not None:
        ahead = ahead & (shift_left(segment_ids, k, -1) == segment_ids)
    return shift_left(targets, k), ahead


def mtp_input(h_prev: jax.Array, embedded: jax.Array, enorm: RMSNorm, hnorm: RMSNorm,
              w_eh: jax.Array) -> jax.Array:
    """DeepSeek-V3 eq. 21: M_k [RMSNorm(h^{k-1}); RMSNorm(Emb(t_{i+k}))], with ``w_eh``
    [2d, d] holding the embedding's rows first (V3's ``eh_proj`` layout)."""
    both = jnp.concatenate([enorm(embedded), hnorm(h_prev)], axis=-1)
    return jnp.dot(both, w_eh.astype(both.dtype))


class MTPModule(nnx.Module):
    """One depth: ``enorm``, ``hnorm``, ``w_eh`` (M_k), ``layer`` (a decoder layer of the
    model's family, made by the model) and ``norm`` (the norm before the shared head)."""

    def __init__(self, cfg: ModelConfig, layer: nnx.Module, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.enorm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.w_eh = make_param(rngs, normal(cfg.init_std), (2 * d, d), (None, "embed"),
                               dtype_of(cfg.param_dtype))
        self.layer = layer
        self.norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)

    def __call__(self, h_prev: jax.Array, embedded: jax.Array, sin: jax.Array, cos: jax.Array,
                 segment_ids: Optional[jax.Array] = None):
        """(h^k before the norm, the normed h^k the head reads, the layer's statistics)."""
        x = mtp_input(h_prev, embedded, self.enorm, self.hnorm, self.w_eh[...])
        h, stats, _ = self.layer(x, sin, cos, None, None, None, segment_ids)
        return h, self.norm(h), stats


def run_depths(modules: MTPModule, h0: jax.Array, embedded: jax.Array, sin: jax.Array,
               cos: jax.Array, segment_ids: Optional[jax.Array] = None):
    """The D modules (stacked [D, ...]) in sequence: ``embedded`` [D, B, S, d] holds the
    embeddings of the tokens 1..D ahead; returns (normed h^k [D, B, S, d], statistics
    stacked [D, ...])."""
    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0),
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    def depth(h_prev, module, emb):
        h, normed, stats = module(h_prev, emb, sin, cos, segment_ids)
        return h, (normed, stats)

    _, (normed, stats) = depth(h0, modules, embedded)
    return normed, stats
