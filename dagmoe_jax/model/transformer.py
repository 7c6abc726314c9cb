"""The Llama-3 style decoder (DAG-MoE Appendix B.1) with scanned layers.

``Transformer(cfg, rngs=...)(tokens)`` returns float32 logits [B, S, V] and an auxiliary dict:

* ``balance_loss``, ``z_loss``: unweighted router losses, averaged over layers (and CoE steps);
* ``aux_loss``: ``balance_coef * balance_loss + z_loss_coef * z_loss``, ready to add to the loss;
* ``expert_load`` [layers, N]: share of routing slots per expert;
* ``dropped_fraction`` [layers]: share of assignments that capacity dispatch dropped.

A 'dense' model reports zeros for all of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.model.attention import Attention, rope_angles
from dagmoe_jax.model.coe import CoEBlock
from dagmoe_jax.model.layers import RMSNorm, SwiGLU, dtype_of, make_param, normal
from dagmoe_jax.model.moe import MoEBlock
from dagmoe_jax.parallel import constrain

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def make_block(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    if cfg.block == "moe":
        return MoEBlock(cfg, rngs=rngs)
    if cfg.block == "coe":
        return CoEBlock(cfg, rngs=rngs)
    return SwiGLU(cfg.d_model, cfg.resolved_ffn_hidden, cfg.init_std, dtype_of(cfg.compute_dtype),
                  rngs=rngs)


def empty_stats(cfg: ModelConfig) -> dict:
    z = jnp.zeros((), jnp.float32)
    return {"balance_loss": z, "z_loss": z, "dropped_fraction": z,
            "expert_load": jnp.zeros((cfg.experts.num_experts,), jnp.float32)}


class DecoderLayer(nnx.Module):
    """h = h + Attn(RMSNorm(h)); h = h + Block(RMSNorm(h))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.block_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs)
        self.block = make_block(cfg, rngs=rngs)

    def __call__(self, h: jax.Array, sin: jax.Array, cos: jax.Array):
        h = h + self.attn(self.attn_norm(h), sin, cos)
        out = self.block(self.block_norm(h))
        out, stats = out if isinstance(out, tuple) else (out, empty_stats(self.cfg))
        h = constrain(h + out.astype(h.dtype), ("batch", "length", "embed"))
        return h, stats


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = dtype_of(cfg.param_dtype)
        self.embed = make_param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                                ("vocab", "embed"), pd)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(r):
            return DecoderLayer(cfg, rngs=r)

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

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0),
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
