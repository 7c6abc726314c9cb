"""Multi-head latent attention (DeepSeek-V2 sec. 2.1; :mod:`dagmoe_jax.model.mla`): against a
plain NumPy transcription of its equations, decoding from the latent cache equal to the whole
forward, causality and gradients; the config's one-line errors. transformers' own attention on
the same weights: tests/test_mla_transformers.py (peer)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.config import MLAConfig, ModelConfig, RopeScalingConfig
from dagmoe_jax.model.attention import rope_angles
from dagmoe_jax.model.mla import LatentCache, MLAttention, mla_softmax_scale

MLA = MLAConfig(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6)
YARN = RopeScalingConfig(kind="yarn", factor=4.0, original_max_position=16, mscale=0.8,
                         mscale_all_dim=0.8)


def mla_config(q_lora: bool = True, **changes) -> ModelConfig:
    mla = MLA if q_lora else MLAConfig(**{**MLA.__dict__, "q_lora_rank": 0})
    return tiny_config("dense").replace(mla=mla, rope_scaling=YARN, rope_theta=10000.0,
                                        **changes)


def numpy_mla(p: dict, cfg: ModelConfig, x: np.ndarray) -> np.ndarray:
    """MLA of x [S, d] for one sequence, head by head and position by position in float64
    (DeepSeek-V2 sec. 2.1.2-2.1.3), RoPE in the half-split layout at the YaRN frequencies."""
    m, h = cfg.mla, cfg.num_heads
    eps = 1e-6          # the latents' norms: the norm class's default in DeepSeek's code
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    s = x.shape[0]

    def rms(v, w):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * w
    sin, cos = (np.asarray(a, np.float64)[0] for a in
                rope_angles(jnp.arange(s)[None], m.qk_rope_head_dim, cfg.rope_theta,
                            cfg.rope_scaling))

    def rope(v, t):                                  # v [d_h^R] at position t
        half = len(v) // 2
        return np.concatenate([v[:half] * cos[t] - v[half:] * sin[t],
                               v[half:] * cos[t] + v[:half] * sin[t]])
    if m.q_lora_rank:
        q = rms(x @ p["w_q_a"], p["q_a_norm"]) @ p["w_q_b"].reshape(m.q_lora_rank, -1)
    else:
        q = x @ p["w_q"].reshape(x.shape[1], -1)
    q = q.reshape(s, h, m.qk_head_dim)
    ckv = x @ p["w_kv_a"]
    c = rms(ckv[:, :m.kv_lora_rank], p["kv_a_norm"])                         # c^KV [S, d_c]
    k_r = np.stack([rope(ckv[t, m.kv_lora_rank:], t) for t in range(s)])    # k^R [S, d_h^R]
    kv = (c @ p["w_kv_b"].reshape(m.kv_lora_rank, -1)).reshape(s, h, -1)
    scale = mla_softmax_scale(cfg)
    out = np.zeros((s, h, m.v_head_dim))
    for i in range(h):
        for t in range(s):
            q_t = np.concatenate([q[t, i, :m.qk_nope_head_dim],
                                  rope(q[t, i, m.qk_nope_head_dim:], t)])
            keys = [np.concatenate([kv[u, i, :m.qk_nope_head_dim], k_r[u]]) for u in range(t + 1)]
            scores = np.array([q_t @ k for k in keys]) * scale
            w = np.exp(scores - scores.max())
            w /= w.sum()
            out[t, i] = sum(w[u] * kv[u, i, m.qk_nope_head_dim:] for u in range(t + 1))
    return out.reshape(s, -1) @ p["w_o"].reshape(h * m.v_head_dim, -1)


def random_module(cfg: ModelConfig, seed: int = 0) -> MLAttention:
    module = MLAttention(cfg, make_model(cfg).execution, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for name, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        value = var.get_value()
        noise = 0.3 * rng.standard_normal(value.shape)
        var.set_value(jnp.asarray((1 + noise if "norm" in name[-1] else noise), value.dtype))
    return module


def params_of(module) -> dict:
    return {path[-1]: np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@pytest.mark.parametrize("q_lora", [True, False])
def test_mla_equals_its_equations(q_lora):
    cfg = mla_config(q_lora)
    module = random_module(cfg)
    x = np.random.default_rng(1).standard_normal((2, 24, cfg.d_model)).astype(np.float32)
    sin, cos = rope_angles(jnp.arange(24)[None], cfg.rope_dim, cfg.rope_theta,
                           cfg.rope_scaling)
    out, outputs = module(jnp.asarray(x), sin, cos)
    assert outputs.k.shape == (2, 24, 4, 12) and outputs.v.shape == (2, 24, 4, 6)
    for b in range(2):
        want = numpy_mla(params_of(module), cfg, x[b].astype(np.float64))
        np.testing.assert_allclose(np.asarray(out[b]), want, rtol=2e-4, atol=2e-5)


def test_the_scale_carries_deepseeks_yarn_mscale():
    cfg = mla_config()
    m = 0.1 * 0.8 * math.log(4.0) + 1
    assert mla_softmax_scale(cfg) == pytest.approx(12 ** -0.5 * m * m)
    assert mla_softmax_scale(cfg.replace(rope_scaling=RopeScalingConfig())) == \
        pytest.approx(12 ** -0.5)


@pytest.mark.parametrize("block", ["dense", "moe"])
def test_decoding_from_the_latent_cache_equals_the_whole_forward(block):
    """Prompt, then tokens one and three at a time, rows at different positions: the logits
    of the absorbed attention over c^KV and k^R equal the whole sequence's forward."""
    cfg = tiny_config(block).replace(mla=MLA, rope_scaling=YARN)
    model = make_model(cfg)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 14)))
    full, _ = model(tokens)
    cache = model.init_cache(2, 16)
    assert isinstance(cache, LatentCache)
    assert cache.c.shape == (2, 2, 16, 16) and cache.k_rope.shape == (2, 2, 16, 4)
    logits, aux = model(tokens[:, :6], cache=cache)
    pieces, cache = [logits], aux["cache"]
    for begin, size in ((6, 1), (7, 3), (10, 4)):
        logits, aux = model(tokens[:, begin:begin + size], cache=cache,
                            start=jnp.full((2,), begin, jnp.int32))
        pieces.append(logits)
        cache = aux["cache"]
    decoded = jnp.concatenate(pieces, axis=1)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), rtol=1e-4, atol=2e-5)


def test_mla_is_causal_and_every_weight_learns():
    cfg = mla_config()
    module = random_module(cfg)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 10, cfg.d_model)), jnp.float32)
    sin, cos = rope_angles(jnp.arange(10)[None], cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    base = module(x, sin, cos)[0]
    later = module(x.at[:, 6:].set(0.0), sin, cos)[0]
    np.testing.assert_array_equal(np.asarray(base[:, :6]), np.asarray(later[:, :6]))
    assert float(jnp.max(jnp.abs(base[:, 6:] - later[:, 6:]))) > 1e-3

    grads = nnx.grad(lambda mod: jnp.sum(mod(x, sin, cos)[0] ** 2))(module)
    for path, var in nnx.to_flat_state(grads):
        assert float(jnp.max(jnp.abs(var.get_value()))) > 0, path


@pytest.mark.parametrize("change, needle", [
    (dict(qk_norm="head"), "qk_norm='head' is invalid"),
    (dict(block="doe"), "block='doe' is invalid"),
    (dict(mla=dict(qk_rope_head_dim=3)), "qk_rope_head_dim=3"),
    (dict(mla=dict(kv_lora_rank=-1)), "kv_lora_rank=-1")])
def test_mla_configs_that_cannot_run_are_one_line(change, needle):
    with pytest.raises(ValueError, match=needle):
        if isinstance(change.get("mla"), dict):
            MLAConfig(**{**MLA.__dict__, **change["mla"]})
        else:
            ModelConfig(**{"mla": MLA, **change})


def test_the_latent_cache_is_576_numbers_a_token_a_layer_at_deepseeks_shape():
    """DeepSeek-V2/V3's d_c 512 + d_h^R 64 against grouped-query attention's 2 x 8 x 128."""
    cfg = ModelConfig(num_layers=1, d_model=1024, num_heads=16, max_seq_len=64,
                      mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536))
    model = make_model(cfg.replace(block="dense"))
    cache = jax.eval_shape(lambda: model.init_cache(1, 8))
    assert sum(a.shape[-1] for a in cache) == 576
    gqa = jax.eval_shape(lambda: make_model(cfg.replace(block="dense", mla=MLAConfig(),
                                                         num_kv_heads=8, head_dim=128))
                         .init_cache(1, 8))
    assert 2 * gqa.k.shape[-2] * gqa.k.shape[-1] == 2048


def test_an_mla_model_is_not_exported_as_a_grouped_query_family():
    from dagmoe_jax.hf.export import hf_family
    with pytest.raises(ValueError, match="ModelConfig.mla .* cannot be exported"):
        hf_family(tiny_config("dense").replace(mla=MLA))
