"""Decoupling of Experts (DoE, seed 003): knowledge state, Attention Gating Control, VAE router.

Our reading of the paper, choice by choice, is docs/design.md section 6. Per layer, with
``x = RMSNorm(h)`` the block input (the paper's H_mha) and the layer computing ``h + out``:

* Attention Gating Control (eq. 1-3): ``Q = x W_Q``, ``A = softmax(Q Z^T / sqrt(d)) Z``,
  ``H_enr = x + A`` with the layer's knowledge state ``Z`` [K, d].
* Routing signal (Appendix B.1, H.1): the causal running mean of the layer's attention values
  ``v_agg,t = mean_{j <= t} v_j`` (keys or queries as the Table 10 ablation).
* VAE router (eq. 5-6): ``mu, log sigma^2 = enc([H_enr ; v_agg (; topic embedding in the first
  layer: E_know[id_t], or theta(<t)^T E_know with DoEConfig.first_input='theta',
  :func:`causal_topic_mixture`)])``, ``z = mu + sigma * eps`` when a noise key is given
  (training), ``z = mu`` without (evaluation, generation). Which VAE a layer uses: the first
  layer's, one shared by every middle layer, the last layer's (``DoEConfig.vae_sharing``); the
  VAEs live once, outside the scanned layer stack (:class:`DoEShared`), and each layer reads its
  entry of the stacked bank.
* Gates (sec. 3.4, Appendix B.2): router logits ``r = W_g z + b`` over all K topics,
  ``G = ReLU(r)`` (or softmax, the VAE-softmax ablation): no top-k, no balance loss.
* Composed expert (Appendix A.1): ``e_context = G^T Z``; block output (Appendix H.2)
  ``FFN([H_enr ; e_context])``. Or (``DoEConfig.expert='blocks'``) every knowledge block owns
  an FFN slice and the output is ``sum_k G_k FFN_k(H_enr)`` over the Top-N non-zero gates
  (:mod:`dagmoe_jax.families.doe.knowledge_blocks`).
* Losses (eq. 4, 7, 9): :func:`expert_loss` (cross-entropy of softmax(r) against the LDA labels),
  :func:`kl_standard_normal`, and :func:`doe_objective` assembling eq. 4 in the training step.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.families.doe.knowledge_blocks import active_blocks, block_hidden, sparse_blocks
from dagmoe_jax.model.block import BlockInputs, BlockStats
from dagmoe_jax.model.layers import dtype_of, make_param, normal, swiglu

VAE_NAMES = ("w_h", "w_s", "b_e", "w_mu", "b_mu", "w_lv", "b_lv", "w_dec", "b_dec")
LOGVAR_CLIP = 10.0


class VAEBank(NamedTuple):
    """The VAE parameters of every bank entry, stacked [vae_count, ...] (names: VAE_NAMES)."""

    w_h: jax.Array
    w_s: jax.Array
    b_e: jax.Array
    w_mu: jax.Array
    b_mu: jax.Array
    w_lv: jax.Array
    b_lv: jax.Array
    w_dec: jax.Array
    b_dec: jax.Array


class DoELayerInputs(NamedTuple):
    """A layer's own DoE inputs: its VAE bank entry, whether it is the last layer (its VAE
    reconstructs the next token's embedding), and its training-noise key (None: z = mu)."""

    index: jax.Array
    is_last: jax.Array
    key: Optional[jax.Array] = None


class DoESharedInputs(NamedTuple):
    """The DoE inputs every layer shares: the VAE bank, the first layer's topic term
    E_know[topic] W_t (or theta(<t)^T E_know W_t, ``first_input='theta'``) [B, S, vae_hidden],
    the reconstruction target (the next token's embedding [B, S, d]; None when the
    reconstruction loss is off or when decoding), and the knowledge state Z [K, d] when every
    layer shares one (``shared_knowledge``; else None)."""

    vae: VAEBank
    topic_term: Optional[jax.Array] = None
    recon_target: Optional[jax.Array] = None
    knowledge: Optional[jax.Array] = None


class DoEStats(NamedTuple):
    """What a DoE block reports beyond the routed blocks' statistics (``BlockStats.extra``):
    the router logits [B, S, K] (for L_expert), the VAE's KL and reconstruction terms, the
    mean gate per knowledge block [K], the share of active blocks (non-zero gates; with
    expert='blocks', those run: in the Top-N and non-zero) and the mean log sigma of the VAE's
    posterior (eq. 5; the noise scale of eq. 6)."""

    router_logits: jax.Array
    kl: jax.Array
    recon: jax.Array
    gate_mean: jax.Array
    active_fraction: jax.Array
    log_sigma: jax.Array


# ------------------------------------------------------------------------------ equations


def dual_input_embedding(token_emb: jax.Array, topic_emb: jax.Array, w_in: jax.Array) -> jax.Array:
    """DoE Algorithm 1, lines 1-3: ``Concat(H_tok, H_know) W_in``, the dual-input embedding
    [B, S, d + d_k] projected back to d (our projection: the paper feeds the concatenation to
    MHA, whose width is d)."""
    return jnp.concatenate([token_emb, topic_emb.astype(token_emb.dtype)], axis=-1) @ w_in


def knowledge_queries(h: jax.Array, w_q: jax.Array) -> jax.Array:
    """DoE eq. 1: ``Q_know = H_mha W_Q``."""
    return h @ w_q


def knowledge_attention(q: jax.Array, z: jax.Array, d_k: Optional[int] = None) -> jax.Array:
    """DoE eq. 2: ``softmax(Q_know Z^T / sqrt(d_k)) Z`` (scores and softmax in float32); d_k
    defaults to d, the width of Q and Z (:func:`knowledge_scale_dim` reads the config)."""
    scores = jnp.einsum("...d,kd->...k", q.astype(jnp.float32), z.astype(jnp.float32))
    p = jax.nn.softmax(scores / math.sqrt(d_k or z.shape[-1]), axis=-1)
    return (p @ z.astype(jnp.float32)).astype(q.dtype)


def knowledge_scale_dim(cfg: ModelConfig) -> int:
    """The d_k of eq. 2 (``DoEConfig.knowledge_scale``): d_model, the topic embedding's width
    (Algorithm 1's d_k) or the attention head's width."""
    return {"d_model": cfg.d_model, "topic_dim": cfg.block.topic_dim,
            "head_dim": cfg.resolved_head_dim}[cfg.block.knowledge_scale]


def enrich(h: jax.Array, attention_know: jax.Array) -> jax.Array:
    """DoE eq. 3: ``H_enriched = H_mha + Attention_know``."""
    return h + attention_know


def causal_running_mean(x: jax.Array) -> jax.Array:
    """``mean_{j <= t} x_j`` along axis 1 of x [B, S, F] (float32): the aggregated attention
    signal of DoE Appendix B.1, made causal (a whole-sequence mean would leak the future)."""
    total = jnp.cumsum(x.astype(jnp.float32), axis=1)
    return total / jnp.arange(1, x.shape[1] + 1, dtype=jnp.float32)[None, :, None]


def cached_running_mean(cache: jax.Array, start: jax.Array, s: int) -> jax.Array:
    """:func:`causal_running_mean` at positions ``start_b + [0, s)`` from a cache [B, T, KV, D]
    holding every position up to them (decoding): float32 [B, s, KV * D]."""
    b, t = cache.shape[:2]
    flat = cache.reshape(b, t, -1).astype(jnp.float32)
    pos = start[:, None] + jnp.arange(s)                                # [B, s]
    visible = (jnp.arange(t)[None, None, :] <= pos[:, :, None]).astype(jnp.float32)
    return jnp.einsum("bst,btf->bsf", visible, flat) / (pos[..., None] + 1.0)


def causal_topic_mixture(topics: jax.Array, topic_embed: jax.Array,
                         counts: Optional[jax.Array] = None) -> jax.Array:
    """The first layer's VAE topic input under ``DoEConfig.first_input='theta'``:
    ``theta(<t)^T E_know`` [B, S, d_k] (float32), the causal topic distribution mixed into the
    topic embedding (DoE sec. 3.2's document-level theta_i and sec. 3.3's "first layer's VAE is
    uniquely conditioned on the static LDA topic priors", made causal; Algorithm 1's E_know).

    ``theta(<t)_k = #{j <= t : id_j = k} / (t + 1)`` over the K + 1 ids (null K included) of
    ``topics`` [B, S]; ``topic_embed`` is E_know [K + 1, d_k]. Each id_j is computed from the
    text strictly before token j (:func:`dagmoe_jax.families.doe.topics.token_topics`), so the ids
    at j <= t describe the text before t: position t sees exactly the ids the default reading's
    position t may see (its own and earlier ones), never a later one. ``counts`` [B, S, K + 1]:
    those counts given directly (KV-cache decoding, where a step's tokens do not hold the
    history: :class:`~dagmoe_jax.families.doe.extension.TopicFeatures` carries them); None computes
    them as the cumulative sum of the ids' one-hots."""
    n = topic_embed.shape[0]
    if counts is None:
        counts = jnp.cumsum(jax.nn.one_hot(topics, n, dtype=jnp.float32), axis=1)
    counts = counts.astype(jnp.float32)
    theta = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    return theta @ topic_embed.astype(jnp.float32)


def vae_encode(pre: jax.Array, w_mu, b_mu, w_lv, b_lv):
    """DoE eq. 5: ``q_phi(z | h) = N(mu_phi(h), diag sigma_phi^2(h))``: mu and log sigma^2 from
    the encoder's hidden pre-activation ``pre`` (one SiLU layer shared by both heads). log
    sigma^2 is clipped to [-10, 10] (our safeguard: exp of an unbounded log-variance overflows)."""
    e = jax.nn.silu(pre)
    logvar = jnp.clip(e @ w_lv + b_lv, -LOGVAR_CLIP, LOGVAR_CLIP)
    return e @ w_mu + b_mu, logvar


def reparameterize(mu: jax.Array, logvar: jax.Array, key: Optional[jax.Array]) -> jax.Array:
    """DoE eq. 6: ``z = mu + sigma * eps``, eps ~ N(0, I) drawn from ``key``; ``z = mu`` when
    ``key`` is None (evaluation and generation use the mean)."""
    if key is None:
        return mu
    eps = jax.random.normal(key, mu.shape, jnp.float32).astype(mu.dtype)
    return mu + jnp.exp(0.5 * logvar) * eps


def kl_standard_normal(mu: jax.Array, logvar: jax.Array) -> jax.Array:
    """The KL term of DoE eq. 7, ``KL(N(mu, sigma^2) || N(0, I))`` summed over the latent:
    ``0.5 * sum(sigma^2 + mu^2 - 1 - log sigma^2)`` per token ([...] float32)."""
    mu, logvar = mu.astype(jnp.float32), logvar.astype(jnp.float32)
    return 0.5 * jnp.sum(jnp.exp(logvar) + mu * mu - 1.0 - logvar, axis=-1)


def gate_values(logits: jax.Array, kind: str) -> jax.Array:
    """DoE sec. 3.4 / Appendix B.2: ``G = ReLU(r)`` ('relu', the paper) or ``softmax(r)``
    ('softmax', Table 3's VAE-softmax ablation) over all K knowledge blocks."""
    if kind == "relu":
        return jax.nn.relu(logits)
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)


def compose_expert(gates: jax.Array, z: jax.Array) -> jax.Array:
    """DoE Appendix A.1: the composed expert ``e_context = G^T Z`` ([..., K] x [K, d])."""
    return gates @ z.astype(gates.dtype)


def routing_signal(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, cache,
                   start: Optional[jax.Array]) -> jax.Array:
    """The router's attention signal [B, S, F] (``DoEConfig.signal``): the causal running mean
    of this call's values (keys, queries), or, when decoding over a KV cache, of the cached
    values (keys) up to each position."""
    src = cfg.block.signal
    if cache is None or start is None:
        x = {"q": q, "k": k, "v": v}[src]
        return causal_running_mean(x.reshape(x.shape[0], x.shape[1], -1))
    if src == "q":
        raise ValueError("DoEConfig.signal='q' cannot be decoded from a KV cache (it holds no "
                         "queries): generate with a 'v' or 'k' model, or score whole sequences")
    return cached_running_mean(cache.k if src == "k" else cache.v, start, q.shape[1])


# ------------------------------------------------------------------------------ which VAE


def vae_count(cfg: ModelConfig) -> int:
    """Entries of the VAE bank: one per layer ('per_layer'), else first / shared middle / last
    (fewer for 1 or 2 layers: one, or first and last)."""
    n = cfg.num_layers
    return n if cfg.block.vae_sharing == "per_layer" else min(n, 3)


def vae_index(cfg: ModelConfig) -> jax.Array:
    """The bank entry of each layer [layers] (hierarchical: 0, 1, ..., 1, last)."""
    n = cfg.num_layers
    if cfg.block.vae_sharing == "per_layer":
        return jnp.arange(n, dtype=jnp.int32)
    idx = [0] + [1] * max(n - 2, 0) + ([min(n, 3) - 1] if n > 1 else [])
    return jnp.asarray(idx, jnp.int32)


def signal_dim(cfg: ModelConfig) -> int:
    heads = cfg.num_heads if cfg.block.signal == "q" else cfg.num_kv_heads
    return heads * cfg.resolved_head_dim


def shared_param_counts(cfg: ModelConfig) -> tuple:
    """(VAE bank, topic embedding + W_in + W_t) parameter counts of :class:`DoEShared`."""
    c, d = cfg.block, cfg.d_model
    vh, dz = c.vae_hidden, c.latent_dim
    one_vae = d * vh + signal_dim(cfg) * vh + vh + 2 * (vh * dz + dz) + dz * d + d
    embedding = (c.num_topics + 1) * c.topic_dim + (d + c.topic_dim) * d + c.topic_dim * vh
    return vae_count(cfg) * one_vae, embedding


def block_weight_shapes(cfg: ModelConfig) -> dict:
    """Each layer's FFN weights: the composed expert's SwiGLU over [H_enr ; e_context] (input 2d)
    or, with expert='blocks', the K knowledge blocks' slices [K, d, h_b] ... [K, h_b, d]."""
    d, k = cfg.d_model, cfg.block.num_topics
    if cfg.block.expert == "blocks":
        hb = block_hidden(cfg)
        return {"block_gate": ((k, d, hb), (None, "embed", None)),
                "block_up": ((k, d, hb), (None, "embed", None)),
                "block_down": ((k, hb, d), (None, None, "embed"))}
    hidden = cfg.resolved_ffn_hidden
    return {"w_gate": ((2 * d, hidden), (None, "mlp")), "w_up": ((2 * d, hidden), (None, "mlp")),
            "w_down": ((hidden, d), ("mlp", "embed"))}


# ------------------------------------------------------------------------------ modules


class DoEShared(nnx.Module):
    """The DoE parameters outside the layer stack: the topic embedding E_know [K + 1, d_k] (row
    K: null), the dual-input projection W_in [d + d_k, d] (initialised to [I ; 0], so at
    initialisation the embedding is the token embedding), the bank of VAEs (each parameter
    stacked [vae_count, ...]), the first layer's topic input weight W_t [d_k, vae_hidden], and,
    with ``shared_knowledge``, the one knowledge state Z [K, d] every layer reads."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        c = cfg.block
        self.cfg = cfg
        d, dk, vh, dz, n = cfg.d_model, c.topic_dim, c.vae_hidden, c.latent_dim, vae_count(cfg)
        pd = dtype_of(cfg.param_dtype)
        init, zeros = normal(cfg.init_std), nnx.initializers.zeros
        eye = lambda key, shape, dtype: jnp.concatenate(
            [jnp.eye(d, dtype=dtype), jnp.zeros((dk, d), dtype)])
        self.topic_embed = make_param(rngs, init, (c.num_topics + 1, dk), (None, None), pd)
        self.w_in = make_param(rngs, eye, (d + dk, d), (None, "embed"), pd)
        self.w_t = make_param(rngs, init, (dk, vh), (None, None), pd)
        if c.shared_knowledge:
            self.knowledge = make_param(rngs, init, (c.num_topics, d), (None, "embed"), pd)
        shapes = {"w_h": (d, vh), "w_s": (signal_dim(cfg), vh), "b_e": (vh,), "w_mu": (vh, dz),
                  "b_mu": (dz,), "w_lv": (vh, dz), "b_lv": (dz,), "w_dec": (dz, d), "b_dec": (d,)}
        for name in VAE_NAMES:
            shape = shapes[name]
            self.__setattr__(f"vae_{name}", make_param(
                rngs, zeros if name.startswith("b_") else init, (n,) + shape,
                (None,) * (len(shape) + 1), pd))

    def bank(self) -> VAEBank:
        return VAEBank(*(getattr(self, f"vae_{name}")[...] for name in VAE_NAMES))

    def prepare(self, tokens: jax.Array, h: jax.Array, embed: jax.Array,
                features: Optional[Mapping[str, jax.Array]], noise: Optional[jax.Array],
                decoding: bool):
        """The dual-input embedding (Algorithm 1) and the layers' DoE inputs: (h, context).

        tokens [B, S], h their token embeddings, embed the embedding table (the last layer's
        reconstruction target is the next token's embedding); ``features['topics']`` [B, S]:
        the causal input topic ids (:func:`dagmoe_jax.families.doe.topics.token_topics`; K = null);
        with ``first_input='theta'`` and a KV cache also ``features['topic_counts']``
        [B, S, K + 1] (:func:`causal_topic_mixture`); ``noise``: a key for the VAE's sampling
        (training; None: z = mu); ``decoding``: a KV cache is in use (no reconstruction
        target)."""
        cfg, c = self.cfg, self.cfg.block
        dt = dtype_of(cfg.compute_dtype)
        topics = None if features is None else features.get("topics")
        if not c.use_topics:
            topics = jnp.full(tokens.shape, c.num_topics, jnp.int32)
        elif topics is None:
            raise ValueError("a DoE model (block='doe') needs features={'topics': [B, S]}, the "
                             "input topic ids of the tokens "
                             "(dagmoe_jax.families.doe.topics.token_topics; batches carry them "
                             "as 'topics')")
        elif tuple(topics.shape) != tuple(tokens.shape):
            raise ValueError(f"topics has shape {tuple(topics.shape)}, the tokens "
                             f"{tuple(tokens.shape)}: pass one topic id per token")
        t_emb = self.topic_embed[...].astype(dt)[topics]
        h = dual_input_embedding(h, t_emb, self.w_in[...].astype(dt))
        vae_topic = t_emb
        if c.first_input == "theta":
            counts = None if features is None else features.get("topic_counts")
            if decoding and counts is None:
                raise ValueError("DoEConfig.first_input='theta' decodes over a KV cache only "
                                 "with features['topic_counts'] [B, S, K + 1], the counts of the "
                                 "topic ids up to each position (the DoE extension's "
                                 "decoding_features tracker gives them)")
            if counts is not None and tuple(counts.shape) != tuple(topics.shape) + (
                    c.num_topics + 1,):
                raise ValueError(f"topic_counts has shape {tuple(counts.shape)}: expected "
                                 f"{tuple(topics.shape) + (c.num_topics + 1,)} (the topics' "
                                 f"shape + (num_topics + 1,))")
            vae_topic = causal_topic_mixture(topics, self.topic_embed[...], counts).astype(dt)
        n = cfg.num_layers
        per_layer = DoELayerInputs(vae_index(cfg), jnp.arange(n) == n - 1,
                                   None if noise is None else jax.random.split(noise, n))
        recon = None
        if c.recon_coef > 0 and not decoding:        # the last layer's VAE target: next token
            nxt = embed.astype(dt)[tokens[:, 1:]]
            recon = jnp.concatenate([nxt, jnp.zeros_like(nxt[:, :1])], axis=1)
        z = self.knowledge[...].astype(dt) if c.shared_knowledge else None
        shared = DoESharedInputs(self.bank(), vae_topic @ self.w_t[...].astype(dt), recon, z)
        return h, per_layer, shared


class DoEBlock(nnx.Module):
    """One layer's DoE block: W_Q of eq. 1, the knowledge state Z [K, d] (unless shared), the
    gate W_g [d_z, K] and b, and the output SwiGLU over [H_enr ; e_context] (input 2d) or the
    knowledge blocks' FFN slices (:func:`block_weight_shapes`)."""

    shared = DoEShared                   # the Transformer builds one as ``model.doe``

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, layout=None, *,
                 rngs: nnx.Rngs):
        del layout                           # nothing to dispatch
        c = cfg.block
        d, k = cfg.d_model, c.num_topics
        pd = dtype_of(cfg.param_dtype)
        init = normal(cfg.init_std)
        self.cfg, self.dtype = cfg, dtype_of(cfg.compute_dtype)
        self.grouped_matmul = execution.grouped_matmul
        self.fuse_projections = execution.fuse_projections
        self.w_q = make_param(rngs, init, (d, d), ("embed", None), pd)
        if not c.shared_knowledge:
            self.knowledge = make_param(rngs, init, (k, d), (None, "embed"), pd)
        self.w_g = make_param(rngs, init, (c.latent_dim, k), (None, None), pd)
        self.b_g = make_param(rngs, nnx.initializers.zeros, (k,), (None,), pd)
        for name, (shape, axes) in block_weight_shapes(cfg).items():
            self.__setattr__(name, make_param(rngs, init, shape, axes, pd))
        self.record_intermediates = False     # analysis switches it on (Module.set_attributes)

    def __call__(self, inputs: BlockInputs) -> tuple[jax.Array, BlockStats]:
        """x = RMSNorm(h) [B, S, d] and the context :meth:`DoEShared.prepare` made; the routing
        signal is the causal running mean of the layer's attention tensor (``DoEConfig.signal``)."""
        att = inputs.attention
        signal = routing_signal(self.cfg, att.q, att.k, att.v, att.cache, att.start)
        return self.apply(inputs.x, signal, inputs.context.per_layer, inputs.context.shared)

    def apply(self, x: jax.Array, signal: jax.Array, layer: DoELayerInputs,
              shared: DoESharedInputs) -> tuple[jax.Array, BlockStats]:
        """The block on ``x`` given its routing ``signal`` [B, S, F] (eq. 1-3, 5, the gates,
        A.1, H.2). Returns (out [B, S, d], stats)."""
        cfg, dt = self.cfg, self.dtype
        c = lambda w: w[...].astype(dt)
        x = x.astype(dt)
        z_know = shared.knowledge.astype(dt) if cfg.block.shared_knowledge else c(self.knowledge)
        h_enr = enrich(x, knowledge_attention(knowledge_queries(x, c(self.w_q)), z_know,
                                              knowledge_scale_dim(cfg)))
        vae = VAEBank(*(v[layer.index].astype(dt) for v in shared.vae))
        pre = h_enr @ vae.w_h + signal.astype(dt) @ vae.w_s + vae.b_e
        if shared.topic_term is not None:            # the first layer's VAE sees the topics
            pre = pre + jnp.where(layer.index == 0, 1.0, 0.0).astype(dt) * shared.topic_term
        mu, logvar = vae_encode(pre, vae.w_mu, vae.b_mu, vae.w_lv, vae.b_lv)
        z = reparameterize(mu, logvar, layer.key)
        logits = z @ c(self.w_g) + c(self.b_g)
        gates = gate_values(logits, cfg.block.gate)
        g32 = gates.astype(jnp.float32)
        if cfg.block.expert == "blocks":
            b, s, d = h_enr.shape
            weights = (c(self.block_gate), c(self.block_up), c(self.block_down))
            out, ids = sparse_blocks(h_enr.reshape(b * s, d), gates.reshape(b * s, -1),
                                     weights, active_blocks(cfg), self.grouped_matmul)
            out = out.reshape(b, s, d)
            active = jnp.mean(jnp.sum(ids < gates.shape[-1], axis=-1)) / gates.shape[-1]
        else:
            e_context = compose_expert(gates, z_know)
            out = swiglu(jnp.concatenate([h_enr, e_context], axis=-1), c(self.w_gate),
                         c(self.w_up), c(self.w_down), fused=self.fuse_projections)
            active = jnp.mean((g32 > 0).astype(jnp.float32))
        share = g32 / jnp.maximum(jnp.sum(g32, axis=-1, keepdims=True), 1e-9)
        zero = jnp.zeros((), jnp.float32)
        recon = zero
        if cfg.block.recon_coef > 0 and shared.recon_target is not None:
            target = jax.lax.stop_gradient(jnp.where(layer.is_last, shared.recon_target, h_enr))
            pred = z @ vae.w_dec + vae.b_dec
            recon = jnp.mean(jnp.sum((pred.astype(jnp.float32) - target.astype(jnp.float32)) ** 2,
                                     axis=-1))
        extra = DoEStats(logits.astype(jnp.float32), jnp.mean(kl_standard_normal(mu, logvar)),
                         recon, jnp.mean(g32, axis=(0, 1)), active.astype(jnp.float32),
                         jnp.mean(0.5 * logvar.astype(jnp.float32)))
        record = {"gates": g32} if self.record_intermediates else None
        return out, BlockStats(zero, zero, zero, jnp.mean(share, axis=(0, 1)), record, extra)


# The family's block (dagmoe_jax.config.families).
BLOCK = DoEBlock
