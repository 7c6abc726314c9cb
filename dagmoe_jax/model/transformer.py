"""The Llama-3 style decoder (DAG-MoE Appendix B.1) with scanned layers.

``Transformer(cfg, rngs=...)(tokens)`` returns float32 logits [B, S, V] and an auxiliary dict:

* ``balance_loss``, ``z_loss``: unweighted router losses, averaged over layers (and CoE steps);
* ``aux_loss``: ``balance_coef * balance_loss + z_loss_coef * z_loss``, ready to add to the loss;
* ``expert_load`` [layers, N]: share of routing slots per expert;
* ``dropped_fraction`` [layers]: share of assignments that capacity dispatch dropped.

A 'dense' model reports zeros for all of them.

For autoregressive decoding (``dagmoe_jax.generate``), ``Transformer.prefill`` runs a prompt
and returns its :class:`~dagmoe_jax.model.attention.KVCache` ([layers, B, T, KV, D], carried
through the same layer scan as the parameters), and ``Transformer.decode`` runs new tokens
against it. Neither changes the training forward pass (``__call__``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.model.attention import Attention, KVCache, rope_angles
from dagmoe_jax.model.coe import CoEBlock
from dagmoe_jax.model.layers import RMSNorm, SwiGLU, dtype_of, make_param, normal
from dagmoe_jax.model.moe import MoEBlock
from dagmoe_jax.parallel import constrain
from dagmoe_jax.parallel.axes import MeshLayout

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def make_block(cfg: ModelConfig, layout: Optional[MeshLayout] = None, *,
               rngs: nnx.Rngs) -> nnx.Module:
    if cfg.block == "moe":
        return MoEBlock(cfg, layout, rngs=rngs)
    if cfg.block == "coe":
        return CoEBlock(cfg, layout, rngs=rngs)
    return SwiGLU(cfg.d_model, cfg.resolved_ffn_hidden, cfg.init_std, dtype_of(cfg.compute_dtype),
                  fuse_gate_up=cfg.fuse_gate_up, rngs=rngs)


def empty_stats(cfg: ModelConfig) -> dict:
    z = jnp.zeros((), jnp.float32)
    return {"balance_loss": z, "z_loss": z, "dropped_fraction": z,
            "expert_load": jnp.zeros((cfg.experts.num_experts,), jnp.float32)}


class DecoderLayer(nnx.Module):
    """h = h + Attn(RMSNorm(h)); h = h + Block(RMSNorm(h)).

    The one exception is the CoE authors' reading (``CoEConfig.stream='reference'``), where
    the block's output, RMSNorm(h) + the experts' updates, replaces h instead of adding to it.
    """

    def __init__(self, cfg: ModelConfig, layout: Optional[MeshLayout] = None, *,
                 rngs: nnx.Rngs):
        self.cfg = cfg
        self.block_replaces_stream = cfg.block == "coe" and cfg.coe.stream == "reference"
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.block_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.block = make_block(cfg, layout, rngs=rngs)

    def __call__(self, h: jax.Array, sin: jax.Array, cos: jax.Array):
        h = h + self.attn(self.attn_norm(h), sin, cos)
        out = self.block(self.block_norm(h))
        out, stats = out if isinstance(out, tuple) else (out, empty_stats(self.cfg))
        return self.add_block_output(h, out), stats

    def add_block_output(self, h: jax.Array, out: jax.Array) -> jax.Array:
        """The layer's second residual: h + out, or out alone for the CoE 'reference' reading."""
        out = out.astype(h.dtype)
        return constrain(out if self.block_replaces_stream else h + out,
                         ("batch", "length", "embed"))

    def _ffn(self, h: jax.Array) -> jax.Array:
        """The second residual half of ``__call__`` (block output only; stats dropped)."""
        out = self.block(self.block_norm(h))
        return self.add_block_output(h, out[0] if isinstance(out, tuple) else out)

    def prefill(self, h: jax.Array, sin: jax.Array, cos: jax.Array):
        """``__call__`` that also returns this layer's keys and values: (h, (k, v))."""
        a, k, v = self.attn.prefill(self.attn_norm(h), sin, cos)
        return self._ffn(h + a), (k, v)

    def decode(self, h: jax.Array, sin: jax.Array, cos: jax.Array, cache: KVCache,
               start: jax.Array):
        """New tokens h [B, S, d] at positions ``start_b + [0, S)`` against this layer's cache
        ([B, T, KV, D] each): (h, updated cache)."""
        a, k, v = self.attn.decode(self.attn_norm(h), sin, cos, cache.k, cache.v, start)
        return self._ffn(h + a), KVCache(k, v)


class Transformer(nnx.Module):
    """The decoder for a settled ``cfg`` (:func:`dagmoe_jax.settle.settle`: no 'auto' left),
    its MoE dispatch placed on ``layout`` (None: one device)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layout: Optional[MeshLayout] = None):
        if cfg.unsettled:
            raise ValueError(f"ModelConfig fields {', '.join(cfg.unsettled)} are still 'auto': "
                             f"build the model from dagmoe_jax.settle.settle(cfg)")
        self.cfg = cfg
        pd = dtype_of(cfg.param_dtype)
        self.embed = make_param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                                ("vocab", "embed"), pd)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(r):
            return DecoderLayer(cfg, layout, rngs=r)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.lm_head = make_param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                                  ("embed", "vocab"), pd)

    def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None):
        """Final-norm hidden states [B, S, d] and the per-layer stats (stacked over layers)."""
        cfg = self.cfg
        b, s = tokens.shape
        if s > cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds ModelConfig.max_seq_len={cfg.max_seq_len}: "
                             f"shorten the inputs or raise max_seq_len")
        if positions is None:
            positions = jnp.arange(s)[None, :]
        sin, cos = rope_angles(positions, cfg.resolved_head_dim, cfg.rope_theta)
        h = self.embed[...].astype(dtype_of(cfg.compute_dtype))[tokens]
        h = constrain(h, ("batch", "length", "embed"))

        def body(h, layer):
            return layer(h, sin, cos)

        if cfg.remat != "none":
            body = nnx.remat(body, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), unroll=cfg.scan_unroll,
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(h, layer):
            return body(h, layer)

        h, stats = run(h, self.layers)
        return self.final_norm(h), stats

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None):
        h, stats = self.hidden_states(tokens, positions)
        b, s, d = h.shape
        logits = jnp.dot(h.reshape(b * s, d), self.lm_head[...].astype(h.dtype),
                         preferred_element_type=jnp.float32).reshape(b, s, -1)
        logits = constrain(logits, ("batch", "length", "vocab"))
        return logits, summarize_stats(self.cfg, stats)

    # ---------------------------------------------------------------- autoregressive decoding

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty (zero) cache of ``length`` slots: k, v [layers, batch, length, KV, D]."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.resolved_head_dim)
        zeros = jnp.zeros(shape, dtype_of(cfg.compute_dtype))
        return KVCache(zeros, zeros)

    def project_logits(self, h: jax.Array) -> jax.Array:
        """Final-norm hidden states [B, S, d] -> float32 logits [B, S, V] (as ``__call__``)."""
        b, s, d = h.shape
        logits = jnp.dot(h.reshape(b * s, d), self.lm_head[...].astype(h.dtype),
                         preferred_element_type=jnp.float32).reshape(b, s, -1)
        return constrain(logits, ("batch", "length", "vocab"))

    def prefill(self, tokens: jax.Array, cache_len: int | None = None,
                logit_positions: jax.Array | None = None):
        """Run prompts ``tokens`` [B, S] at positions 0..S-1 and build the cache for decoding.

        Prompts of different lengths are right-padded (any pad id): causal attention never lets
        a real token see the padding after it, and the padding's cache slots are overwritten by
        :meth:`decode` before any query can see them. Layers run exactly as in ``__call__``
        (same attention kernel and dispatch) without rematerialisation.

        cache_len: slots of the returned cache (>= S; default S), zero past S.
        logit_positions: [B] one position per row (e.g. ``length - 1``) to return logits
          [B, V] for; None returns all of them, [B, S, V].
        Returns (logits, KVCache with k, v [layers, B, cache_len, KV, D]).
        """
        cfg = self.cfg
        b, s = tokens.shape
        cache_len = s if cache_len is None else cache_len
        if s > cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds ModelConfig.max_seq_len="
                             f"{cfg.max_seq_len}: shorten the inputs or raise max_seq_len")
        if cache_len < s:
            raise ValueError(f"cache_len={cache_len} is shorter than the prompts ({s} tokens)")
        sin, cos = rope_angles(jnp.arange(s)[None, :], cfg.resolved_head_dim, cfg.rope_theta)
        h = self.embed[...].astype(dtype_of(cfg.compute_dtype))[tokens]
        h = constrain(h, ("batch", "length", "embed"))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(h, layer):
            return layer.prefill(h, sin, cos)

        h, (k, v) = run(h, self.layers)
        pad = ((0, 0), (0, 0), (0, cache_len - s), (0, 0), (0, 0))
        cache = KVCache(jnp.pad(k, pad), jnp.pad(v, pad))
        h = self.final_norm(h)
        if logit_positions is None:
            return self.project_logits(h), cache
        h = h[jnp.arange(b), logit_positions][:, None]
        return self.project_logits(h)[:, 0], cache

    def decode(self, tokens: jax.Array, start: jax.Array, cache: KVCache):
        """Run new tokens [B, S] (usually S = 1) at positions ``start_b + [0, S)`` per row
        against ``cache``, writing their keys and values into it.

        The cache must hold each row's positions ``< start_b`` (from :meth:`prefill` and earlier
        calls). Returns (logits [B, S, V] float32, updated cache). Equal, up to float rounding,
        to ``__call__``'s logits at those positions on the rows' full sequences when routing
        drops nothing (see ``dagmoe_jax.generate`` on the dispatch used for decoding).
        """
        cfg = self.cfg
        start = jnp.asarray(start, jnp.int32)
        positions = start[:, None] + jnp.arange(tokens.shape[1])
        sin, cos = rope_angles(positions, cfg.resolved_head_dim, cfg.rope_theta)
        h = self.embed[...].astype(dtype_of(cfg.compute_dtype))[tokens]
        h = constrain(h, ("batch", "length", "embed"))

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0),
                  transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(h, layer, layer_cache):
            return layer.decode(h, sin, cos, layer_cache, start)

        h, cache = run(h, self.layers, cache)
        return self.project_logits(self.final_norm(h)), cache


def summarize_stats(cfg: ModelConfig, stats: dict) -> dict:
    """Per-layer stats [layers, ...] -> the auxiliary dict documented in this module."""
    balance = jnp.mean(stats["balance_loss"])
    z = jnp.mean(stats["z_loss"])
    return {
        "balance_loss": balance,
        "z_loss": z,
        "aux_loss": cfg.router.balance_coef * balance + cfg.router.z_loss_coef * z,
        "expert_load": stats["expert_load"],
        "dropped_fraction": stats["dropped_fraction"],
    }
