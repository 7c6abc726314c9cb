"""The block protocol: how a decoder layer calls its FFN block, whatever the block is.

Every block (dense SwiGLU, MoE with any aggregator and shared experts, Chain-of-Experts, DoE)
is a module called the same way, ``block(inputs: BlockInputs) -> (out, BlockStats)``, and is
found through its family's registration (the ``BLOCK`` of ``dagmoe_jax.families.<kind>.block``,
:func:`dagmoe_jax.model.transformer.block_class`), so
:class:`~dagmoe_jax.model.transformer.DecoderLayer` has no branch per block type. It is built
as ``Block(cfg, execution, layout, rngs=...)``: the model config, how it runs on this machine
(a settled ``ExecutionConfig``) and the mesh its dispatch spans (None: one device). A block
class may name intermediates (``jax.ad_checkpoint.checkpoint_name``) that remat 'dots' keeps
beside the products, as its ``saved_names`` (none where it names none;
:func:`dagmoe_jax.model.transformer.remat_policy`).

A block family that needs parameters outside the layer stack, or inputs beyond the normed
stream (DoE's topic embedding and VAE bank, its per-layer noise keys), declares a *shared*
module class (``Block.shared``): the Transformer builds one (attribute named after the
block), whose ``prepare(...)`` turns the token embeddings and the batch's per-token features
into the embeddings the layers see and a :class:`BlockContext` (per-layer inputs, scanned with
the layers, and inputs shared by every layer), which reaches each block as
``inputs.context``.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp

from dagmoe_jax.model.attention import AttentionOutputs


class BlockContext(NamedTuple):
    """A block family's extra inputs: ``per_layer`` (leaves with a leading layer axis outside
    the layer scan, this layer's slice inside it) and ``shared`` (the same for every layer)."""

    per_layer: Any = None
    shared: Any = None


class BlockInputs(NamedTuple):
    """A block's inputs: ``x`` = RMSNorm(h) [B, S, d], the layer's attention outputs, and the
    family's context (None for blocks without a shared module)."""

    x: jax.Array
    attention: Optional[AttentionOutputs] = None
    context: Optional[BlockContext] = None


class BlockStats(NamedTuple):
    """What every block reports (stacked over layers by the scan):

    balance_loss, z_loss: unweighted router losses (0 for blocks without a router);
    dropped_fraction: share of routed assignments capacity dispatch or a bounded exchange
      buffer dropped;
    expert_load [N]: share of routing slots (or of gate mass) per expert;
    record: the intermediates analysis reads, when the block's ``record_intermediates`` is on;
    extra: the family's own statistics (DoE: :class:`~dagmoe_jax.families.doe.block.DoEStats`);
    router_counts [R, N] int32: with auxiliary-loss-free balancing, each of the block's R
      routers' assignments per expert, in the order of its ``balanced_routers()`` (the
      training step moves their selection biases by them); None without.
    """

    balance_loss: jax.Array
    z_loss: jax.Array
    dropped_fraction: jax.Array
    expert_load: jax.Array
    record: Optional[Dict[str, jax.Array]] = None
    extra: Any = None
    router_counts: Optional[jax.Array] = None


def empty_stats() -> BlockStats:
    """The statistics of a block without routing: zero losses, no expert load ([0])."""
    zero = jnp.zeros((), jnp.float32)
    return BlockStats(zero, zero, zero, jnp.zeros((0,), jnp.float32))


def routed_stats(losses: dict, keep: jax.Array, expert_load: jax.Array,
                 record: Optional[dict] = None) -> BlockStats:
    """The statistics of a routed block from its router's losses and the dispatch's keep mask
    (the dropped share is the mean of the dropped mask, not 1 - mean(keep): exactly 0, never
    -3e-8, when nothing drops); a router with a selection bias gives its ``expert_counts`` as
    the one row of ``router_counts``."""
    dropped = jnp.mean(jnp.logical_not(keep).astype(jnp.float32))
    counts = losses.get("expert_counts")
    return BlockStats(losses["balance_loss"], losses["z_loss"], dropped, expert_load, record,
                      router_counts=None if counts is None else counts[None])
