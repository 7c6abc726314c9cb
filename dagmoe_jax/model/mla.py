"""Multi-head latent attention (DeepSeek-V2 sec. 2.1, kept by DeepSeek-V3): ``ModelConfig.mla``.

For a token's hidden state h (DeepSeek-V2 sec. 2.1.2-2.1.3):

* queries: q = h W_Q, or with a query compression (``q_lora_rank`` > 0) q = RMSNorm(h W_DQ) W_UQ;
  each head's q splits into q^C [d_h] and q^R [d_h^R], and RoPE turns q^R;
* keys and values: one latent c^KV = RMSNorm(h W_DKV) [d_c] and one RoPE key
  k^R = RoPE(h W_KR) [d_h^R] per token, shared by the heads; each head's k^C [d_h] and
  v [d_v] are c^KV W_UKV;
* attention of head i: softmax([q^C_i; q^R_i] . [k^C_i; k^R] / sqrt(d_h + d_h^R)) v_i (times
  mscale^2 in the scale under DeepSeek's YaRN), then o W_O.

Training and scoring expand k and v and run the model's causal attention kernel (values
zero-padded to the key width where they are narrower, as transformers does for flash
attention). A decoding cache (:class:`LatentCache`) holds c^KV and k^R alone,
d_c + d_h^R numbers a token a layer (DeepSeek-V2/V3: 576, against GQA's 2 KV d_h: 2,048 for 8
KV heads of 128), and decoding attends to it directly: W_UK is absorbed into the query
(q^C_i W_UK,i^T . c^KV) and W_UV applied after the weighted sum of latents
(:func:`latent_attention`), so no past key or value is expanded again.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.model.attention import (AttentionOutputs, apply_rope, causal_attention,
                                        write_cache)
from dagmoe_jax.model.layers import dtype_of, make_param, normal, rms_norm
from dagmoe_jax.parallel import constrain

LATENT_NORM_EPS = 1e-6
"""The epsilon of the latents' RMSNorms, whatever ``ModelConfig.norm_eps`` is: DeepSeek's code
and transformers' build them at the norm class's default (1e-6), not ``rms_norm_eps``."""
from dagmoe_jax.parallel.axes import MeshLayout


class LatentCache(NamedTuple):
    """What MLA keeps of past positions: c [layers, B, T, d_c] (the normed latent c^KV) and
    k_rope [layers, B, T, d_h^R] (k^R after RoPE); [B, T, ...] for one layer inside the scan.
    Slots as :class:`~dagmoe_jax.model.attention.KVCache`'s."""

    c: jax.Array
    k_rope: jax.Array


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """The scores' scale: (d_h + d_h^R)^(-1/2), times mscale^2 where ``rope_scaling`` is YaRN
    with ``mscale_all_dim`` set, mscale = 0.1 mscale_all_dim ln(factor) + 1 (1 for factor <= 1;
    DeepSeek-V2/V3, transformers' ``yarn_apply_mscale``)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs.kind == "yarn" and rs.mscale_all_dim and rs.factor > 1:
        mscale = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
        scale *= mscale * mscale
    return scale


def latent_attention(q_nope: jax.Array, q_rope: jax.Array, c: jax.Array, k_rope: jax.Array,
                     w_uk: jax.Array, w_uv: jax.Array, start: jax.Array,
                     scale: float) -> jax.Array:
    """Attention of new queries over a latent cache, with the up-projections absorbed.

    q_nope [B, S, H, d_h], q_rope [B, S, H, d_h^R] hold row b's positions ``start_b + [0, S)``;
    c [B, T, d_c] and k_rope [B, T, d_h^R] are the cache, already holding those positions.
    Scores s_its = (q^C_is W_UK,i^T) . c_t + q^R_is . k^R_t (w_uk [d_c, H, d_h]), times
    ``scale``, over slots t <= start_b + s; out_is = (sum_t p_its c_t) W_UV,i (w_uv
    [d_c, H, d_v]): equal to expanding every k^C and v and attending, up to rounding.
    Returns [B, S, H, d_v]; scores and softmax in float32.
    """
    b, s = q_nope.shape[:2]
    t = c.shape[1]
    q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, w_uk, preferred_element_type=jnp.float32)
    scores = (jnp.einsum("bshr,btr->bhst", q_latent.astype(c.dtype), c,
                         preferred_element_type=jnp.float32)
              + jnp.einsum("bshp,btp->bhst", q_rope, k_rope,
                           preferred_element_type=jnp.float32)) * scale
    q_pos = start[:, None] + jnp.arange(s)                               # [B, S]
    visible = jnp.arange(t)[None, None, :] <= q_pos[:, :, None]          # [B, S, T]
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    weights = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(c.dtype)
    o_latent = jnp.einsum("bhst,btr->bshr", weights, c, preferred_element_type=jnp.float32)
    o = jnp.einsum("bshr,rhv->bshv", o_latent.astype(c.dtype), w_uv,
                   preferred_element_type=jnp.float32)
    return o.astype(q_nope.dtype)


class MLAttention(nnx.Module):
    """Multi-head latent attention (module docstring) with :class:`Attention`'s interface:
    ``execution`` the settled kernel, ``layout`` the mesh."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig,
                 layout: Optional[MeshLayout] = None, *, rngs: nnx.Rngs):
        m = cfg.mla
        d, h = cfg.d_model, cfg.num_heads
        self.cfg, self.execution, self.layout = cfg, execution, layout
        self.dtype = dtype_of(cfg.compute_dtype)
        self.scale = mla_softmax_scale(cfg)
        pd, init, ones = dtype_of(cfg.param_dtype), normal(cfg.init_std), nnx.initializers.ones
        if m.q_lora_rank:
            self.w_q_a = make_param(rngs, init, (d, m.q_lora_rank), ("embed", None), pd)
            self.q_a_norm = make_param(rngs, ones, (m.q_lora_rank,), (None,))
            self.w_q_b = make_param(rngs, init, (m.q_lora_rank, h, m.qk_head_dim),
                                    (None, "heads", "head_dim"), pd)
        else:
            self.w_q = make_param(rngs, init, (d, h, m.qk_head_dim),
                                  ("embed", "heads", "head_dim"), pd)
        self.w_kv_a = make_param(rngs, init, (d, m.kv_lora_rank + m.qk_rope_head_dim),
                                 ("embed", None), pd)
        self.kv_a_norm = make_param(rngs, ones, (m.kv_lora_rank,), (None,))
        self.w_kv_b = make_param(rngs, init, (m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim),
                                 (None, "heads", "head_dim"), pd)
        self.w_o = make_param(rngs, init, (h, m.v_head_dim, d), ("heads", "head_dim", "embed"),
                              pd)

    def project(self, x: jax.Array, sin: jax.Array, cos: jax.Array):
        """(q^C [B, S, H, d_h], q^R after RoPE [B, S, H, d_h^R], c^KV [B, S, d_c], k^R after
        RoPE [B, S, d_h^R]) of x [B, S, d]; sin, cos [.., S, d_h^R / 2]."""
        m, eps = self.cfg.mla, LATENT_NORM_EPS
        b, s, d = x.shape
        x2 = x.astype(self.dtype).reshape(b * s, d)
        weight = lambda w: w[...].astype(self.dtype)   # noqa: E731
        if m.q_lora_rank:
            cq = rms_norm(x2 @ weight(self.w_q_a), self.q_a_norm[...], eps)
            q = cq @ weight(self.w_q_b).reshape(m.q_lora_rank, -1)
        else:
            q = x2 @ weight(self.w_q).reshape(d, -1)
        q = q.reshape(b, s, -1, m.qk_head_dim)
        q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        q_rope = apply_rope(q_rope, sin, cos)
        ckv = x2 @ weight(self.w_kv_a)
        c = rms_norm(ckv[:, :m.kv_lora_rank], self.kv_a_norm[...], eps).reshape(b, s, -1)
        k_rope = apply_rope(ckv[:, m.kv_lora_rank:].reshape(b, s, 1, -1), sin, cos)[:, :, 0]
        return q_nope, q_rope, c, k_rope

    def expand(self, c: jax.Array, k_rope: jax.Array):
        """Every head's key [k^C; k^R] [B, T, H, d_h + d_h^R] and value [B, T, H, d_v] of the
        latents c [B, T, d_c] and RoPE keys k_rope [B, T, d_h^R]."""
        m = self.cfg.mla
        b, t, r = c.shape
        kv = (c.reshape(b * t, r) @ self.w_kv_b[...].astype(self.dtype).reshape(r, -1))
        kv = kv.reshape(b, t, -1, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv[..., :m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
        k_rope = jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + k_rope.shape[-1:])
        return jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), v

    def project_out(self, o: jax.Array) -> jax.Array:
        b, s, h, dv = o.shape
        w_o = self.w_o[...].astype(self.dtype).reshape(h * dv, -1)
        out = (o.reshape(b * s, h * dv) @ w_o).reshape(b, s, -1)
        return constrain(out, ("batch", "length", "embed"))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
               segment_ids: Optional[jax.Array]) -> jax.Array:
        """Causal attention of the expanded heads by the settled kernel, at MLA's scale: q, k
        and v zero-padded to one width D (the kernels take one head width) and q multiplied by
        scale * sqrt(D) (they divide by sqrt(D)); the values' padding is cut off again."""
        width = max(q.shape[-1], v.shape[-1])
        pad = lambda x: x if x.shape[-1] == width else jnp.pad(   # noqa: E731
            x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
        q = (q.astype(jnp.float32) * (self.scale * math.sqrt(width))).astype(q.dtype)
        q = constrain(pad(q), ("batch", "length", "heads", "head_dim"))
        k = constrain(pad(k), ("batch", "length", "heads", "head_dim"))
        v = constrain(pad(v), ("batch", "length", "heads", "head_dim"))
        ex = self.execution
        o = causal_attention(q, k, v, ex.attention, ex.attention_block, self.layout, segment_ids)
        return o[..., :self.cfg.mla.v_head_dim]

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array,
                 cache: Optional[LatentCache] = None, start: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None):
        """As :meth:`Attention.__call__`, with a :class:`LatentCache`: without ``start`` the
        prompt's latents fill slots [0, S) beside causal attention over x; with ``start`` [B]
        x's latents are written at ``start_b + [0, S)`` and the queries attend over the cache
        (:func:`latent_attention`). The :class:`AttentionOutputs` hold this call's queries
        [q^C; q^R] and, without ``start``, its expanded keys and values (else None)."""
        q_nope, q_rope, c, k_rope = self.project(x, sin, cos)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        if cache is not None:
            first = jnp.zeros((x.shape[0],), jnp.int32) if start is None else start
            cache = LatentCache(write_cache(cache.c, c, first),
                                write_cache(cache.k_rope, k_rope, first))
        if cache is None or start is None:
            k, v = self.expand(c, k_rope)
            o = self.attend(q, k, v, segment_ids)
        else:
            k = v = None
            w = self.w_kv_b[...].astype(self.dtype)
            m = self.cfg.mla
            o = latent_attention(q_nope, q_rope, cache.c, cache.k_rope,
                                 w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:],
                                 start, self.scale)
        return self.project_out(o), AttentionOutputs(q, k, v, cache, start)
