"""The Llama-3 style decoder (DAG-MoE Appendix B.1) with scanned layers.

``Transformer(cfg, rngs=...)(tokens)`` returns float32 logits [B, S, V] and an
auxiliary dict (``cfg``: what is computed; ``execution``: how, a settled
:class:`~dagmoe_jax.config.ExecutionConfig`, :func:`dagmoe_jax.model.settle.settle`):

* ``balance_loss``, ``z_loss``: unweighted router losses, averaged over layers (and CoE steps);
* ``aux_loss``: ``balance_coef * balance_loss + z_loss_coef * z_loss``, ready to add to the loss;
* ``expert_load`` [layers, N]: share of routing slots per expert;
* ``dropped_fraction`` [layers]: share of assignments that capacity dispatch or a bounded
  exchange buffer (``ExpertConfig.exchange_buffer``) dropped;
* ``router_counts`` [layers, R, N] int32, only with auxiliary-loss-free balancing
  (``RouterConfig.aux_free_bias_rate`` > 0): each router's assignments per expert, what
  :meth:`Transformer.update_selection_bias` moves the routers' selection biases by.

A block family without a router (dense, DoE) reports zero losses, and a dense model an
``expert_load`` of [layers, 0]. With the routed blocks' ``record_intermediates``
flag on (``model.set_attributes(record_intermediates=True, raise_if_not_found=False)``), the
dict also holds ``intermediates``, stacked over layers: ``indices`` [layers, C, T, K] (the
routed expert ids in rank order; C = 1 except for CoE, one row per iteration) and, for the DAG,
``edge_gates`` [layers, L, T, K, K, d_g] and ``dag_inputs`` [layers, L, T, K, d]
(``dagmoe_jax.analysis.collection`` reads them).

For autoregressive decoding (``dagmoe_jax.decoding.generate``) the same ``__call__`` takes a
:class:`~dagmoe_jax.model.attention.KVCache` ([layers, B, T, KV, D], carried through the same
layer scan as the parameters; with MLA a :class:`~dagmoe_jax.model.mla.LatentCache`, with
``first_dense_layers`` a :class:`StackCaches` of one per stack): a prompt fills it, new tokens
at given positions read and extend it, and the updated cache comes back in the auxiliary dict
(``aux['cache']``).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig, family_of, router_of
from dagmoe_jax.model.attention import Attention, KVCache, rope_angles
from dagmoe_jax.model.mla import LatentCache, MLAttention
from dagmoe_jax.model.block import BlockContext, BlockInputs, BlockStats
from dagmoe_jax.model.layers import RMSNorm, dtype_of, make_param, normal
from dagmoe_jax.model.mtp import MTPModule, run_depths, shift_left
from dagmoe_jax.model.settle import settle
from dagmoe_jax.model.segments import check_segment_ids, segment_positions
from dagmoe_jax.parallel import constrain
from dagmoe_jax.parallel.axes import MeshLayout


def block_class(cfg: ModelConfig) -> type:
    """The block of ``cfg``'s family (its ``block`` module's ``BLOCK``; the block protocol:
    :mod:`dagmoe_jax.model.block`)."""
    return family_of(cfg.block).part("block").BLOCK


def remat_policy(name: str, saved_names: Sequence[str] = ()):
    """The ``jax.checkpoint`` policy of ``ExecutionConfig.remat`` ``name`` (settled: 'full'
    or 'dots'): 'full' keeps nothing; 'dots' the products and the values a block names
    (``saved_names``, its class's: the DAG module's per-node statistics and messages, which
    recomputing would re-read the experts' outputs for)."""
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*saved_names))


class DecoderLayer(nnx.Module):
    """h = h + Attn(RMSNorm(h)); h = h + Block(RMSNorm(h)).

    The one exception is a block whose ``replaces_stream`` is set: the CoE authors' reading
    (``CoEConfig.stream='reference'``), where the block's output, RMSNorm(h) + the experts'
    updates, replaces h instead of adding to it.
    """

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig,
                 layout: Optional[MeshLayout] = None, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.attn = (MLAttention if cfg.mla.enabled else Attention)(cfg, execution, layout,
                                                                    rngs=rngs)
        self.block_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.block = block_class(cfg)(cfg, execution, layout, rngs=rngs)

    def __call__(self, h: jax.Array, sin: jax.Array, cos: jax.Array,
                 cache: Optional[KVCache] = None, start: Optional[jax.Array] = None,
                 context: Optional[BlockContext] = None,
                 segment_ids: Optional[jax.Array] = None):
        """(h, stats, cache) after this layer; ``cache``, ``start`` and ``segment_ids`` (packed
        examples) as :class:`Attention`; ``context``: this layer's share of the block family's
        inputs (the block protocol, :mod:`dagmoe_jax.model.block`)."""
        a, attention = self.attn(self.attn_norm(h), sin, cos, cache, start, segment_ids)
        h = h + a
        out, stats = self.block(BlockInputs(self.block_norm(h), attention, context))
        return self.add_block_output(h, out), stats, attention.cache

    def add_block_output(self, h: jax.Array, out: jax.Array) -> jax.Array:
        """The layer's second residual: h + out, or out alone for the CoE 'reference' reading."""
        out = out.astype(h.dtype)
        replaces = getattr(self.block, "replaces_stream", False)
        return constrain(out if replaces else h + out,
                         ("batch", "length", "embed"))


class Transformer(nnx.Module):
    """The decoder ``cfg`` describes, run as ``execution``, its MoE dispatch placed on
    ``layout`` (None: one device). ``execution`` (default: every choice 'auto') has whatever
    is left 'auto' settled here for this machine and ``layout``
    (:func:`dagmoe_jax.model.settle.settle`); a run settles it once when it is built, prints
    it and passes it in settled. ``self.execution`` is the settled one."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
                 execution: Optional[ExecutionConfig] = None,
                 layout: Optional[MeshLayout] = None):
        if execution is None or execution.unsettled:
            execution = settle(cfg, execution, layout=layout)
        self.cfg, self.execution = cfg, execution
        pd = dtype_of(cfg.param_dtype)
        self.embed = make_param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                                ("vocab", "embed"), pd)

        def stack(layer_cfg: ModelConfig, count: int):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_layers(r):
                return DecoderLayer(layer_cfg, execution, layout, rngs=r)
            return make_layers(rngs)

        dense = cfg.first_dense_config()
        if dense is not None:                 # DeepSeek's first_k_dense_replace layers
            self.dense_layers = stack(dense, dense.num_layers)
        self.layers = stack(cfg, cfg.routed_layers)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.lm_head = make_param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                                  ("embed", "vocab"), pd)
        shared = getattr(block_class(cfg), "shared", None)
        if shared is not None:            # the block family's parameters outside the layers
            setattr(self, cfg.block.kind, shared(cfg, rngs=rngs))
        if cfg.mtp.depth:                 # DeepSeek-V3's multi-token prediction (training)
            @nnx.split_rngs(splits=cfg.mtp.depth)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_depths(r):
                return MTPModule(cfg, DecoderLayer(cfg, execution, layout, rngs=r), rngs=r)
            self.mtp = make_depths(rngs)

    def __call__(self, tokens: jax.Array, *, cache: Optional[KVCache] = None,
                 start: Optional[jax.Array] = None, logit_positions: Optional[jax.Array] = None,
                 head: bool = True, features: Optional[Mapping[str, jax.Array]] = None,
                 noise: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None):
        """The one forward pass: tokens [B, S] -> (float32 logits, aux).

        Training and scoring call ``model(tokens)``: positions 0..S-1, causal attention.
        Autoregressive decoding passes a ``cache`` (:meth:`init_cache`, [layers, B, T, KV, D]):
        without ``start`` the tokens are a prompt at positions 0..S-1 (right-padded rows: causal
        attention never lets a real token see the padding after it) whose keys and values fill
        slots [0, S); with ``start`` [B] they are row b's positions ``start_b + [0, S)``
        attending over the cache. The updated cache is returned as ``aux['cache']``.
        ``logit_positions`` [B] projects only those positions' logits ([B, V] instead of
        [B, S, V]; the LM head is the costliest matmul at a large vocabulary).
        ``head=False`` stops before the LM head and returns the final-normed hidden states
        [B, S, d] (compute dtype) in place of the logits: the training loss applies the head
        itself, a chunk at a time (:func:`dagmoe_jax.model.tiled_loss.tiled_cross_entropy`
        with ``self.lm_head``), so the [B, S, V] logits never exist.

        A block family with a shared module (:mod:`dagmoe_jax.model.block`; DoE) reads the
        batch's per-token ``features`` (DoE: ``{'topics': [B, S]}``, the causal input topic
        ids) and ``noise``, a key for its training noise (DoE's VAE sampling; without it the
        router uses z = mu). Its own statistics, stacked over layers, are ``aux['extra']``
        (DoE: :class:`~dagmoe_jax.families.doe.block.DoEStats`).

        ``segment_ids`` int [B, S] packs several examples in a row (equal nonzero ids: one
        example, 0: padding; docs/design.md section 1): RoPE positions restart at 0 at each
        example's first token (:func:`~dagmoe_jax.model.segments.segment_positions`) and
        attention stays inside each example, so every example's logits are those it gets alone.
        Training and scoring only (not with a ``cache``); None is the unpacked model, unchanged.
        """
        cfg = self.cfg
        b, s = tokens.shape
        if s > cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds ModelConfig.max_seq_len={cfg.max_seq_len}: "
                             f"shorten the inputs or raise max_seq_len")
        slots = None if cache is None else jax.tree.leaves(cache)[0].shape[2]
        if cache is not None and start is None and slots < s:
            raise ValueError(f"the cache has {slots} slots, fewer than the prompts' "
                             f"{s} tokens: make it with init_cache(batch, length >= {s})")
        if segment_ids is not None:
            if cache is not None:
                raise ValueError("segment_ids (packed examples) are for training and scoring; "
                                 "decoding with a KV cache takes one sequence per row: pass "
                                 "segment_ids=None with a cache")
            segment_ids = check_segment_ids(segment_ids, tokens.shape)
            positions = segment_positions(segment_ids)
        elif start is None:
            positions = jnp.arange(s)[None, :]                       # one row serves the batch
        else:
            positions = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(s)
        sin, cos = rope_angles(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        h = self.embed[...].astype(dtype_of(cfg.compute_dtype))[tokens]
        per_layer = shared_inputs = None
        shared = getattr(self, cfg.block.kind, None)
        if shared is not None:
            h, per_layer, shared_inputs = shared.prepare(tokens, h, self.embed[...], features,
                                                         noise, decoding=cache is not None)
        h = constrain(h, ("batch", "length", "embed"))

        def body(h, layer, layer_cache, layer_inputs, shared_inputs):
            context = (None if layer_inputs is None and shared_inputs is None
                       else BlockContext(layer_inputs, shared_inputs))
            h, stats, layer_cache = layer(h, sin, cos, layer_cache, start, context, segment_ids)
            return h, (stats, layer_cache)

        ex = self.execution
        if ex.remat != "none":
            policy = remat_policy(ex.remat, getattr(block_class(self.cfg), "saved_names", ()))
            body = nnx.remat(body, policy=policy, prevent_cse=False)

        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0, None), out_axes=(nnx.Carry, 0),
                  unroll=ex.scan_unroll,
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(h, layer, layer_cache, layer_inputs, shared_inputs):
            return body(h, layer, layer_cache, layer_inputs, shared_inputs)

        dense_cache, cache = ((cache.dense, cache.routed) if isinstance(cache, StackCaches)
                              else (None, cache))
        if hasattr(self, "dense_layers"):     # the first layers' dense blocks: no statistics
            h, (_, dense_cache) = run(h, self.dense_layers, dense_cache, None, None)
        h, (stats, cache) = run(h, self.layers, cache, per_layer, shared_inputs)
        if dense_cache is not None:
            cache = StackCaches(dense_cache, cache)
        h = self.final_norm(h)
        aux = summarize_stats(cfg, stats)
        if stats.record is not None:
            aux["intermediates"] = stats.record
        if stats.extra is not None:
            aux["extra"] = stats.extra
        if stats.router_counts is not None:
            aux["router_counts"] = stats.router_counts
        if cache is not None:
            aux["cache"] = cache
        if not head:
            return h, aux
        if logit_positions is not None:
            h = h[jnp.arange(b), logit_positions][:, None]
        logits = jnp.dot(h.reshape(-1, cfg.d_model), self.lm_head[...].astype(h.dtype),
                         preferred_element_type=jnp.float32).reshape(h.shape[:2] + (-1,))
        logits = constrain(logits, ("batch", "length", "vocab"))
        return (logits[:, 0] if logit_positions is not None else logits), aux

    def predict_further(self, h: jax.Array, targets: jax.Array,
                        segment_ids: Optional[jax.Array] = None):
        """The multi-token prediction modules (``ModelConfig.mtp``; :mod:`~dagmoe_jax.model.mtp`)
        on the final-normed hidden states ``h`` [B, S, d] of ``model(inputs, head=False)``
        whose next tokens are ``targets`` [B, S]: (normed h^k [D, B, S, d] for the shared head,
        their statistics summarised over the depths as ``aux`` is over layers)."""
        cfg = self.cfg
        if segment_ids is not None:
            positions = segment_positions(check_segment_ids(segment_ids, targets.shape))
        else:
            positions = jnp.arange(targets.shape[1])[None, :]
        sin, cos = rope_angles(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        embed = self.embed[...].astype(h.dtype)
        ahead = jnp.stack([embed[shift_left(targets, k)] for k in range(cfg.mtp.depth)])
        normed, stats = run_depths(self.mtp, h, ahead, sin, cos, segment_ids)
        aux = summarize_stats(cfg, stats)
        if stats.router_counts is not None:
            aux["router_counts"] = stats.router_counts
        return normed, aux

    def update_selection_bias(self, router_counts: jax.Array) -> None:
        """Auxiliary-loss-free balancing's update after a training step (DeepSeek-V3 sec.
        2.1.2; :func:`~dagmoe_jax.model.routed.router.aux_free_bias_update`): every router's selection
        bias moves towards balance by the step's ``router_counts`` [layers, R, N] (the forward
        pass's ``aux['router_counts']``, summed over micro-batches), in place. With
        multi-token prediction the training loss appends the modules' rows ([layers + D, R,
        N]: :meth:`predict_further`'s), which move theirs."""
        stacks = [(self.layers, 0, self.cfg.routed_layers)]
        if self.cfg.mtp.depth and router_counts.shape[0] > self.cfg.routed_layers:
            stacks.append((self.mtp.layer, self.cfg.routed_layers, router_counts.shape[0]))
        for stack, first, last in stacks:
            routers = getattr(stack.block, "balanced_routers", list)()
            for r, router in enumerate(routers):      # each is stacked over its layers
                router.update_selection_bias(router_counts[first:last, r])

    def init_cache(self, batch: int, length: int):
        """An empty (zero) cache of ``length`` slots: a ``KVCache`` k, v [layers, batch,
        length, KV, D], or with MLA a ``LatentCache`` c [layers, batch, length, d_c] and
        k_rope [layers, batch, length, d_h^R]; with ``first_dense_layers`` a
        :class:`StackCaches` of one such cache per stack of layers."""
        cfg = self.cfg
        if cfg.first_dense_layers:
            return StackCaches(empty_cache(cfg, cfg.first_dense_layers, batch, length),
                               empty_cache(cfg, cfg.routed_layers, batch, length))
        return empty_cache(cfg, cfg.num_layers, batch, length)


class StackCaches(NamedTuple):
    """The decoding cache of a model with ``first_dense_layers``: one per stack of layers
    (the dense ones', then the family's), each as :meth:`Transformer.init_cache` makes it."""

    dense: Any
    routed: Any


def empty_cache(cfg: ModelConfig, layers: int, batch: int, length: int):
    """A zero ``KVCache`` (or ``LatentCache`` with MLA) of ``layers`` layers."""
    dtype = dtype_of(cfg.compute_dtype)
    if cfg.mla.enabled:
        rows = (layers, batch, length)
        return LatentCache(jnp.zeros(rows + (cfg.mla.kv_lora_rank,), dtype),
                           jnp.zeros(rows + (cfg.mla.qk_rope_head_dim,), dtype))
    zeros = jnp.zeros((layers, batch, length, cfg.num_kv_heads, cfg.resolved_head_dim), dtype)
    return KVCache(zeros, zeros)


def summarize_stats(cfg: ModelConfig, stats: BlockStats) -> dict:
    """Per-layer stats [layers, ...] -> the auxiliary dict documented in this module."""
    balance = jnp.mean(stats.balance_loss)
    z = jnp.mean(stats.z_loss)
    router = router_of(cfg.block)                    # None: the family does not route
    return {
        "balance_loss": balance,
        "z_loss": z,
        "aux_loss": (router.balance_coef * balance + router.z_loss_coef * z if router
                     else jnp.zeros((), jnp.float32)),
        "expert_load": stats.expert_load,
        "dropped_fraction": stats.dropped_fraction,
    }
