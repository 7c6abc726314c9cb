"""Grouped-query causal self-attention with RoPE (Llama-3; DAG-MoE Appendix B.1)."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.model.layers import dtype_of, make_param, normal
from dagmoe_jax.model.segments import segment_mask
from dagmoe_jax.kernels.attention import fused_causal_attention
from dagmoe_jax.kernels.gpu_attention import triton_attention_supported, triton_causal_attention
from dagmoe_jax.kernels.pallas import splash_causal_attention, splash_supported
from dagmoe_jax.parallel import constrain
from dagmoe_jax.parallel.axes import MeshLayout, logical_to_spec


def llama3_inv_freq(inv_freq: np.ndarray, scaling) -> np.ndarray:
    """Llama 3.1 RoPE scaling of the frequencies ``inv_freq`` (Hugging Face
    ``_compute_llama3_parameters``; ``scaling`` a ``RopeScalingConfig``).

    With wavelength w = 2 pi / f, L = original_max_position, low = L / low_freq_factor and
    high = L / high_freq_factor: f / factor where w > low, f where w < high, and in between
    (1 - s) f / factor + s f with s = (L / w - low_freq_factor) / (high_freq_factor -
    low_freq_factor).
    """
    inv_freq = np.asarray(inv_freq, np.float64)
    old = float(scaling.original_max_position)
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor
                                                          - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def yarn_inv_freq(inv_freq: np.ndarray, theta: float, scaling) -> np.ndarray:
    """YaRN's frequencies (Peng et al., 2023, arXiv:2309.00071: interpolation "by parts"; the
    convention of Hugging Face's ``_compute_yarn_parameters``) of the RoPE frequencies
    ``inv_freq`` = theta^(-2i/D), i < D/2 (``scaling`` a ``RopeScalingConfig``).

    Pair i turns r_i = L f_i / (2 pi) times over L = original_max_position. The pair index at
    which r = beta is d(beta) = D ln(L / (2 pi beta)) / (2 ln theta); the ramp runs from
    low = d(beta_fast) to high = d(beta_slow) (floored and ceiled with ``truncate``, clipped
    to [0, D - 1]; high + 0.001 where they meet): gamma_i = clip((i - low) / (high - low), 0,
    1), and f'_i = gamma_i f_i / s + (1 - gamma_i) f_i with s = ``factor``: pairs that turn
    often keep their frequency, pairs that turn less than once are interpolated.
    """
    inv_freq = np.asarray(inv_freq, np.float64)
    dim, old = 2 * inv_freq.shape[0], float(scaling.original_max_position)

    def pair(rotations: float) -> float:
        return dim * np.log(old / (rotations * 2 * np.pi)) / (2 * np.log(float(theta)))
    low, high = pair(scaling.beta_fast), pair(scaling.beta_slow)
    if scaling.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, dim - 1.0)
    if low == high:
        high += 0.001
    gamma = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return gamma * inv_freq / float(scaling.factor) + (1.0 - gamma) * inv_freq


def rope_attention_factor(scaling) -> float:
    """What RoPE's sin and cos are multiplied by (YaRN's attention temperature, so q.k scales by
    its square): 1 but for 'yarn', where it is ``attention_factor`` if set, else m(mscale) /
    m(mscale_all_dim) where both are set, else m(1), with m(c) = 0.1 c ln s + 1 for s =
    ``factor`` > 1 (1 for s <= 1)."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor:
        return float(scaling.attention_factor)

    def m(c: float) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * c * float(np.log(scaling.factor)) + 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return m(scaling.mscale) / m(scaling.mscale_all_dim)
    return m(1.0)


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """RoPE frequencies theta^(-2i/D), i < D/2 ([D/2] float32), scaled by ``scaling`` (a
    ``RopeScalingConfig``; None or kind 'none': unscaled)."""
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None and scaling.kind == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif scaling is not None and scaling.kind == "linear":      # position interpolation
        inv_freq = inv_freq / float(scaling.factor)
    elif scaling is not None and scaling.kind == "yarn":
        inv_freq = yarn_inv_freq(inv_freq, theta, scaling)
    return inv_freq.astype(np.float32)


def rope_angles(positions: jax.Array, head_dim: int, theta: float,
                scaling=None) -> Tuple[jax.Array, jax.Array]:
    """RoPE sin and cos for integer ``positions`` [..., S]: shapes [..., S, head_dim / 2];
    ``scaling``: a ``RopeScalingConfig`` (:func:`rope_inv_freq`; YaRN's also scales both by
    :func:`rope_attention_factor`)."""
    inv_freq = jnp.asarray(rope_inv_freq(head_dim, theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    factor = rope_attention_factor(scaling)
    if factor == 1.0:
        return jnp.sin(angles), jnp.cos(angles)
    return jnp.sin(angles) * factor, jnp.cos(angles) * factor


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate halves of ``x`` [B, S, H, D] (the Llama / GPT-NeoX layout); sin, cos [B or 1, S, D/2]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _grouped(q: jax.Array, num_kv: int) -> jax.Array:
    b, s, h, d = q.shape
    return q.reshape(b, s, num_kv, h // num_kv, d)


def causal_attention_reference(q, k, v, segment_ids=None):
    """Full S x S causal attention for q [B,S,H,D], k, v [B,S,KV,D]: the oracle for tests.
    ``segment_ids`` [B, S] (packed examples, :mod:`dagmoe_jax.model.segments`): query i also
    needs key j in its own segment (:func:`~dagmoe_jax.model.segments.segment_mask`)."""
    b, s, h, d = q.shape
    qg = _grouped(q, k.shape[2]).astype(jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32))
    mask = (jnp.tril(jnp.ones((s, s), bool)) if segment_ids is None
            else segment_mask(segment_ids)[:, None, None])
    scores = jnp.where(mask, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))
    return out.reshape(b, s, h, d).astype(q.dtype)


def blockwise_causal_attention(q, k, v, block: int, segment_ids=None):
    """Causal attention that skips the blocks above the diagonal.

    Query block i attends to the key prefix [0, (i + 1) * block): one dense matmul per query
    block, masking only its diagonal block, so about half of the S x S work of a full causal
    attention is never done. Exact (softmax over the whole visible prefix), not an approximation.

    Layout for CPU efficiency: heads-major [B, KV, S, G, D] so that the G query heads sharing a
    KV head become extra rows of one matmul ([B, KV, block * G, D] x [B, KV, D, prefix]), and the
    softmax normalisation is applied to the [.., D] output rather than the [.., prefix] weights.

    ``segment_ids`` [B, S] (packed examples): each block's causal mask also requires the query
    and key to share a segment id (:func:`~dagmoe_jax.model.segments.segment_mask`); every
    query sees at least itself, so no row is empty.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qh = (q * (1.0 / float(d) ** 0.5)).reshape(b, s, kv, g, d).transpose(0, 2, 1, 3, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)        # [B, KV, S, D]
    outs = []
    for start in range(0, s, block):
        stop = min(start + block, s)
        rows = (stop - start) * g
        qb = qh[:, :, start:stop].reshape(b, kv, rows, d)
        scores = jnp.einsum("bkrd,bksd->bkrs", qb, kh[:, :, :stop],
                            preferred_element_type=jnp.float32)
        q_pos = start + jnp.arange(rows) // g
        visible = jnp.arange(stop)[None, :] <= q_pos[:, None]               # [rows, stop]
        if segment_ids is not None:                                           # [B, 1, rows, stop]
            same = segment_ids[:, q_pos, None] == segment_ids[:, None, :stop]
            visible = (visible & same)[:, None]
        scores = jnp.where(visible, scores, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
        e = jnp.exp(scores - m)
        o = jnp.einsum("bkrs,bksd->bkrd", e.astype(v.dtype), vh[:, :, :stop],
                       preferred_element_type=jnp.float32)
        o = o / jnp.sum(e, axis=-1, keepdims=True)
        outs.append(o.astype(q.dtype).reshape(b, kv, stop - start, g, d))
    out = jnp.concatenate(outs, axis=2)                              # [B, KV, S, G, D]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, s, h, d)


def sharded_splash_attention(q, k, v, layout: MeshLayout, segment_ids=None, *,
                             interpret: bool = False):
    """The splash kernel on each device's shard (a Mosaic kernel cannot be partitioned by XLA):
    a ``shard_map`` over the mesh axes of the ``batch`` rows and of the ``heads`` / ``kv_heads``
    (the query heads of a KV head stay on its device when both split evenly); ``segment_ids``
    [B, S] are split by rows like the batch."""
    q_spec = logical_to_spec(("batch", "length", "heads", "head_dim"), layout.rules)
    kv_spec = logical_to_spec(("batch", "length", "kv_heads", "head_dim"), layout.rules)
    kernel = partial(splash_causal_attention, interpret=interpret)
    if segment_ids is None:
        return jax.shard_map(kernel, mesh=layout.mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q, k, v)
    seg_spec = logical_to_spec(("batch", "length"), layout.rules)
    return jax.shard_map(lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg),
                         mesh=layout.mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v, segment_ids)


def splash_shardable(q, k, layout: MeshLayout) -> bool:
    """Whether ``layout``'s mesh splits the batch rows and both head counts of q [B, S, H, D],
    k [B, S, KV, D] evenly (else :func:`causal_attention` runs XLA's attention)."""
    q_spec = logical_to_spec(("batch", "length", "heads", "head_dim"), layout.rules)
    kv_spec = logical_to_spec(("batch", "length", "kv_heads", "head_dim"), layout.rules)
    size = lambda entry: layout.size(() if entry is None  # noqa: E731
                                     else (entry,) if isinstance(entry, str) else entry)
    return (q.shape[0] % size(q_spec[0]) == 0 and q.shape[2] % size(q_spec[2]) == 0
            and k.shape[2] % size(kv_spec[2]) == 0)


def causal_attention(q, k, v, impl: str, block: int, layout: Optional[MeshLayout] = None,
                     segment_ids: Optional[jax.Array] = None):
    """The causal attention kernel ``impl`` (a settled ``ExecutionConfig.attention``: 'blockwise',
    'fused', 'xla', 'cudnn', 'triton' or 'splash'; GQA: H a multiple of KV heads). 'splash'
    and 'triton' take sequences that are a multiple of their 128 block (training) and
    'splash', on a mesh (``layout``), batch and head counts its axes divide; other shapes
    (sampling prompts) run XLA's attention.

    ``segment_ids`` int32 [B, S] (packed examples; :mod:`dagmoe_jax.model.segments`): every
    implementation also masks keys of other segments: blockwise and the reference in their
    masks, 'fused' by the kernel's segmented entry points, 'splash' by the kernel's own
    ``SegmentIds``, 'triton' by the flash kernel's segment ids, 'xla' and 'cudnn' by a [B, 1, S, S] ``mask`` beside ``is_causal`` (cuDNN
    takes it as an additive bias). None: exactly the unsegmented code of each.
    """
    if impl == "blockwise":
        return blockwise_causal_attention(q, k, v, block, segment_ids)
    if impl == "fused":
        return fused_causal_attention(q, k, v, segment_ids)
    if impl == "triton" and triton_attention_supported(q.shape[1]):
        return triton_causal_attention(q, k, v, segment_ids=segment_ids)
    if impl == "splash" and splash_supported(q.shape[1]):
        if layout is None:
            return splash_causal_attention(q, k, v, segment_ids=segment_ids)
        if splash_shardable(q, k, layout):
            return sharded_splash_attention(q, k, v, layout, segment_ids)
    if impl == "auto":
        raise ValueError("ExecutionConfig.attention='auto' reached the model unsettled: build the "
                         "model with execution=dagmoe_jax.model.settle.settle(cfg, execution)")
    implementation = "cudnn" if impl == "cudnn" else "xla"
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=implementation)
    return jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segment_ids)[:, None],
                                        is_causal=True, implementation=implementation)


class KVCache(NamedTuple):
    """Keys (after RoPE) and values of past positions, for autoregressive decoding.

    k, v: [layers, B, T, KV, D] for the whole model (stacked along the scanned layer axis, like
    the parameters), [B, T, KV, D] for one layer inside the scan. Slot p of row b holds that
    row's position p: each row's tokens start at slot 0 (prompts are right-padded), so rows of
    different lengths simply fill different numbers of slots. Slots a row has not written yet
    hold anything (zeros or a padded prompt's keys); :func:`cached_attention` never looks past
    the querying position, and decoding overwrites them before they become visible.
    """

    k: jax.Array
    v: jax.Array


class AttentionOutputs(NamedTuple):
    """What a layer's attention computed, for blocks that route on it (DoE's signal): the
    queries, keys and values of this call after RoPE [B, S, heads, D], the updated cache and
    the decoding positions (both None when scoring whole sequences)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    cache: Optional[KVCache] = None
    start: Optional[jax.Array] = None


def write_cache(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write ``new`` [B, S, KV, D] into ``cache`` [B, T, KV, D] at slots ``start_b + [0, S)``.

    Writes past the end of the cache are dropped.
    """
    b, s = new.shape[:2]
    slots = start[:, None] + jnp.arange(s)
    return cache.at[jnp.arange(b)[:, None], slots].set(new.astype(cache.dtype), mode="drop")


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array) -> jax.Array:
    """Attention of new queries over a KV cache (the decoding counterpart of causal attention).

    q [B, S, H, D] holds row b's positions ``start_b + [0, S)``; k, v [B, T, KV, D] are the
    cache, already holding those positions' own keys. Query i of row b sees slots
    ``j <= start_b + i``: exactly the keys causal attention over the row's full sequence gives
    it, so the result equals :func:`causal_attention` at those positions up to float rounding.
    Scores and the softmax are float32, normalised after the value product as in
    :func:`blockwise_causal_attention`.
    """
    b, s, h, d = q.shape
    t, kv = k.shape[1], k.shape[2]
    qg = (q * (1.0 / float(d) ** 0.5)).reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32)
    q_pos = start[:, None] + jnp.arange(s)                              # [B, S]
    visible = jnp.arange(t)[None, None, :] <= q_pos[:, :, None]         # [B, S, T]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    o = jnp.einsum("bkgst,btkd->bkgsd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.sum(e, axis=-1, keepdims=True)
    return o.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)


def qk_rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of queries or keys x [B, S, heads, head_dim] over the axes ``scale`` spans:
    ``scale`` [head_dim] normalises each head on its own (Qwen3's ``q_norm`` / ``k_norm``,
    ``ModelConfig.qk_norm='head'``); ``scale`` [heads, head_dim] normalises each position's
    concatenated heads as one vector (OLMoE's, applied to the whole projection: 'full').
    Statistics in float32, as :func:`~dagmoe_jax.model.layers.rms_norm`."""
    axes = tuple(range(x.ndim - scale.ndim, x.ndim))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: H query heads share KV heads in groups of H / KV;
    ``execution``: the settled kernel (``attention``, ``attention_block``) and whether q, k, v
    are one matmul (``fuse_projections``); ``layout``: the mesh a Pallas kernel ('splash')
    runs on shard by shard (None: one device)."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig,
                 layout: Optional[MeshLayout] = None, *, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self.cfg, self.execution, self.layout = cfg, execution, layout
        self.dtype = dtype_of(cfg.compute_dtype)
        pd = dtype_of(cfg.param_dtype)
        init = normal(cfg.init_std)
        self.w_q = make_param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"), pd)
        self.w_k = make_param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.w_v = make_param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.w_o = make_param(rngs, init, (h, hd, d), ("heads", "head_dim", "embed"), pd)
        if cfg.qk_norm != "none":   # learned scales of qk_rms_norm, ones at initialisation
            ones = nnx.initializers.ones
            per_head = cfg.qk_norm == "head"
            self.q_norm = make_param(rngs, ones, (hd,) if per_head else (h, hd),
                                     ("head_dim",) if per_head else ("heads", "head_dim"))
            self.k_norm = make_param(rngs, ones, (hd,) if per_head else (kv, hd),
                                     ("head_dim",) if per_head else ("kv_heads", "head_dim"))

    def project_qkv(self, x: jax.Array, sin: jax.Array, cos: jax.Array):
        # 2-D matmuls over [B*S, d]: XLA on CPU runs the weight gradient of a rank-3 einsum
        # (two contracted axes) several times slower.
        b, s, d = x.shape
        x2 = x.astype(self.dtype).reshape(b * s, d)
        ws = [w[...].astype(self.dtype).reshape(d, -1) for w in (self.w_q, self.w_k, self.w_v)]
        if self.execution.fuse_projections:  # one matmul against [W_q | W_k | W_v] (config.py)
            parts = jnp.split(x2 @ jnp.concatenate(ws, axis=1),
                              [ws[0].shape[1], ws[0].shape[1] + ws[1].shape[1]], axis=1)
        else:
            parts = [x2 @ w for w in ws]
        q, k, v = (p.reshape(b, s, *w.shape[1:])
                   for p, w in zip(parts, (self.w_q, self.w_k, self.w_v)))
        if self.cfg.qk_norm != "none":
            q = qk_rms_norm(q, self.q_norm[...], self.cfg.norm_eps)
            k = qk_rms_norm(k, self.k_norm[...], self.cfg.norm_eps)
        q = constrain(apply_rope(q, sin, cos), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, sin, cos), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v

    def project_out(self, o: jax.Array) -> jax.Array:
        b, s, h, hd = o.shape
        w_o = self.w_o[...].astype(self.dtype).reshape(h * hd, -1)
        out = (o.reshape(b * s, h * hd) @ w_o).reshape(b, s, -1)
        return constrain(out, ("batch", "length", "embed"))

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array,
                 cache: Optional[KVCache] = None, start: Optional[jax.Array] = None,
                 segment_ids: Optional[jax.Array] = None):
        """Attention of x [B, S, d] (sin, cos: RoPE of its positions); returns (out [B, S, d],
        :class:`AttentionOutputs`: this call's q, k, v after RoPE, the cache, ``start``).
        Blocks that route on attention read q, k or v (DoE's signal); XLA drops what none
        reads.

        * ``cache`` None: causal self-attention over x (training, scoring); the cache is None.
        * ``cache`` given, ``start`` None (prefill): x holds positions 0..S-1; causal
          self-attention as above, and x's keys and values are written into cache slots
          [0, S) (the cache [B, T, KV, D] needs T >= S).
        * ``cache`` and ``start`` [B] given (decode): x holds row b's positions
          ``start_b + [0, S)``; its keys and values are written there first, then every query
          attends over the cache slots up to its own position (:func:`cached_attention`).

        ``segment_ids`` [B, S] (packed examples, no cache): attention stays inside each
        example (:func:`causal_attention`).
        """
        q, k, v = self.project_qkv(x, sin, cos)
        if cache is not None:
            first = jnp.zeros((x.shape[0],), jnp.int32) if start is None else start
            cache = KVCache(write_cache(cache.k, k, first), write_cache(cache.v, v, first))
        if cache is None or start is None:
            ex = self.execution
            o = causal_attention(q, k, v, ex.attention, ex.attention_block, self.layout,
                                 segment_ids)
        else:
            o = cached_attention(q, cache.k, cache.v, start)
        return self.project_out(o), AttentionOutputs(q, k, v, cache, start)
