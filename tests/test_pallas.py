"""The Pallas TPU kernels (splash attention, megablox gmm) in interpret mode on CPU, against the
reference attention, jax.lax.ragged_dot and a NumPy grouped matmul; and where settle puts them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import np_grouped_matmul, tiny_config
from dagmoe_jax.kernels import grouped_matmul_unavailable, pallas
from dagmoe_jax.model.routed import dispatch as dispatch_lib
from dagmoe_jax.model.attention import causal_attention_reference
from dagmoe_jax.model.settle import describe, settle, settle_attention, settle_grouped_matmul

from test_dispatch import np_expert_outputs, random_weights


def test_splash_attention_equals_the_reference_forward_and_backward(rng):
    # 128 positions (one splash block), 4 query heads over 2 KV heads (GQA), head_dim 16
    b, s, h, kv, d = 2, 128, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((b, s, h, d), (b, s, kv, d), (b, s, kv, d)))
    probe = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)
    splash = functools.partial(pallas.splash_causal_attention, interpret=True)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * probe)

    out, grads = jax.jit(lambda q, k, v: (splash(q, k, v),
                                          jax.grad(loss(splash), argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    ref = causal_attention_reference(q, k, v)
    ref_grads = jax.grad(loss(causal_attention_reference), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")
    # causality: the first position sees only itself, so its output is its own value
    np.testing.assert_allclose(out[:, 0], jnp.repeat(v[:, 0], h // kv, axis=1), rtol=1e-5)


def test_splash_refuses_shapes_it_cannot_tile():
    assert pallas.splash_supported(256) and not pallas.splash_supported(100)
    x = jnp.zeros((1, 100, 2, 8))
    with pytest.raises(ValueError, match="multiple of 128.*attention='xla'"):
        pallas.splash_causal_attention(x, x, x, interpret=True)


def test_gmm_equals_ragged_dot_and_the_dense_oracle(rng):
    # 300 rows in 128-row tiles: groups cross tile boundaries, two are empty, none is a
    # multiple of the tile, and 17 rows past the last group must come out zero
    sizes = np.array([37, 0, 129, 1, 0, 116], np.int32)
    m, k, n = int(sizes.sum()) + 17, 32, 24
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    gsizes = jnp.asarray(sizes)
    gmm = functools.partial(pallas.gmm_grouped_matmul, interpret=True)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b, gsizes) * probe)

    out, grads = jax.jit(lambda a, b: (gmm(a, b, gsizes),
                                       jax.grad(loss(gmm), argnums=(0, 1))(a, b)))(lhs, rhs)
    ref_grads = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    np.testing.assert_allclose(out, np_grouped_matmul(np.asarray(lhs), np.asarray(rhs), sizes),
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs, gsizes), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[-17:] == 0)
    for name, g, r in zip(("lhs", "rhs"), grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=name)
    assert np.all(np.asarray(grads[1])[[1, 4]] == 0)            # empty groups: no gradient


def test_gmm_told_every_row_is_in_a_group_equals_ragged_dot_without_selects(rng):
    """``zero_tail=False`` (local dropless dispatch: sum(sizes) == M) leaves out the
    selects that zero rows past the groups; with none there, the values and gradients are
    ragged_dot's, the row tile's padding (300 rows in 128-row tiles) cut off."""
    sizes = jnp.asarray(np.array([37, 0, 129, 1, 0, 133], np.int32))
    m, k, n = 300, 32, 24
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(6, k, n)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    told = functools.partial(pallas.gmm_grouped_matmul, zero_tail=False, interpret=True)

    def value_and_grads(fn):
        return jax.value_and_grad(lambda a, b: jnp.sum(fn(a, b, sizes) * probe),
                                  argnums=(0, 1))

    (value, grads), (ref, ref_grads) = (jax.jit(value_and_grads(f))(lhs, rhs)
                                        for f in (told, jax.lax.ragged_dot))
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    for name, g, r in zip(("lhs", "rhs"), grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=name)
    selects = [str(jax.make_jaxpr(value_and_grads(f))(lhs, rhs)).count("select_n")
               for f in (told, functools.partial(pallas.gmm_grouped_matmul, interpret=True))]
    assert selects[0] < selects[1], selects


def test_dropless_dispatch_through_gmm_equals_the_oracle(monkeypatch):
    monkeypatch.setitem(dispatch_lib.GROUPED_MATMUL, "gmm",
                        functools.partial(pallas.gmm_grouped_matmul, interpret=True))
    rng = np.random.default_rng(3)
    t, k = 20, 2
    x = jnp.asarray(rng.normal(size=(t, 16)), jnp.float32)
    indices = np.stack([rng.permutation(3)[:k] for _ in range(t)]).astype(np.int32)  # 3 of 4
    weights = random_weights(rng)
    out, keep = jax.jit(functools.partial(dispatch_lib.dropless_dispatch,
                                          grouped_matmul="gmm"))(x, jnp.asarray(indices), weights)
    assert not np.any(indices == 3) and bool(jnp.all(keep))          # an empty expert
    np.testing.assert_allclose(out, np_expert_outputs(x, indices, weights), rtol=1e-5, atol=1e-5)


def test_settle_picks_the_accelerator_kernels():
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    assert settle_attention("auto", "tpu", bf16, 128, None) == ("splash", "")
    assert settle_attention("auto", "gpu", bf16, 64, None) == ("cudnn", "")
    assert settle_attention("auto", "gpu", bf16, 12, None)[0] == "xla"       # not a multiple of 8
    assert "head_dim <= 128" in settle_attention("auto", "gpu", bf16, 256, None)[1]
    assert "16-bit" in settle_attention("auto", "gpu", f32, 64, None)[1]
    assert settle_grouped_matmul("auto", "tpu", 512, 256) == "gmm"
    assert settle_grouped_matmul("auto", "tpu", 512, 96) == "ragged_dot"    # not 128-tiled
    assert settle_grouped_matmul("auto", "gpu", 512, 256) == "ragged_dot"
    assert settle_grouped_matmul("ragged_dot", "tpu", 512, 256) == "ragged_dot"
    cfg = tiny_config(d_model=128, experts=dict(expert_hidden=128, dispatch="dropless"))
    tpu = settle(cfg, backend="tpu")
    assert (tpu.attention, tpu.grouped_matmul) == ("splash", "gmm")
    assert describe(cfg, tpu, None, "tpu").startswith("attention splash, remat full")
    assert "grouped matmul gmm" in describe(cfg, tpu, None, "tpu")
    # on CPU the C++ grouped matmul where it builds (tests/test_grouped_matmul.py)
    cpu_kernel = "cpu_gmm" if grouped_matmul_unavailable("cpu") is None else "ragged_dot"
    assert settle(cfg, backend="cpu").grouped_matmul == cpu_kernel
