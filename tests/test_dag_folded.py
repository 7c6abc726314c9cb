"""The DAG module's LayerNorm folded into W_down (``dag_module='xla'``,
dagmoe_jax/families/moe/dag/folded.py) against eq. 7-8 as written: the NumPy transcription, the
composed XLA form's values and gradients, and nodes whose mean dwarfs their spread."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dagmoe_jax.families.moe.dag import layer_norm
from dagmoe_jax.families.moe.dag.folded import folded_norm_projection

EPS = 1e-5


def np_norm_projection(x, scale, bias, w_down, eps=EPS):
    """DAG-MoE eq. 7-8 in float64: LayerNorm over d, then W_down."""
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + eps) * scale + bias) @ w_down


def operands(rng, n=96, d=64, dg=16, offset=0.0):
    x = rng.normal(size=(n, d)) * rng.uniform(0.5, 3.0, size=(n, 1)) + offset
    return (x, 1 + 0.3 * rng.normal(size=d), 0.2 * rng.normal(size=d),
            rng.normal(size=(d, dg)) / np.sqrt(d))


@pytest.mark.parametrize("offset", [0.0, 30.0], ids=["centred", "mean-30"])
def test_folded_projection_equals_eq_7_8_in_float32(offset):
    args = operands(np.random.default_rng(0), offset=offset)
    want = np_norm_projection(*args)
    got = folded_norm_projection(*(jnp.asarray(a, jnp.float32) for a in args), EPS)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_folded_gradients_equal_the_composed_form():
    args = [jnp.asarray(a, jnp.float32) for a in operands(np.random.default_rng(1))]
    probe = jnp.asarray(np.random.default_rng(2).normal(size=(96, 16)), jnp.float32)

    def loss(f):
        return lambda *a: jnp.sum(f(*a) * probe)

    composed = lambda x, s, b, w: layer_norm(x, s, b, EPS) @ w          # noqa: E731
    folded = lambda x, s, b, w: folded_norm_projection(x, s, b, w, EPS)  # noqa: E731
    want = jax.grad(loss(composed), argnums=(0, 1, 2, 3))(*args)
    got = jax.grad(loss(folded), argnums=(0, 1, 2, 3))(*args)
    for name, g, w in zip(("x", "ln_scale", "ln_bias", "w_down"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                                   atol=1e-4 * np.abs(np.asarray(w)).max(), err_msg=name)


def test_folded_projection_in_bfloat16_is_within_its_rounding():
    """In bfloat16 the folded form rounds W' where the composed one rounds the normalised
    nodes: both sit within bfloat16's rounding of the float64 transcription."""
    args = operands(np.random.default_rng(3))
    want = np_norm_projection(*args)
    bf = [jnp.asarray(args[0], jnp.bfloat16), *(jnp.asarray(a, jnp.float32) for a in args[1:])]
    folded = np.asarray(folded_norm_projection(*bf, EPS), np.float64)
    composed = np.asarray(layer_norm(bf[0], *bf[1:3], EPS) @ bf[3].astype(jnp.bfloat16),
                          np.float64)
    scale = np.abs(want).max()
    assert np.abs(folded - want).max() <= 2 * max(np.abs(composed - want).max(), 4e-3 * scale)
