"""JAX's Pallas Triton flash attention as this model's 'triton' attention
(dagmoe_jax/kernels/gpu_attention.py), in the Pallas interpreter on CPU: output and the three
gradients equal the reference attention, with grouped-query heads and packed segments."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dagmoe_jax.kernels.gpu_attention import triton_attention_supported, triton_causal_attention
from dagmoe_jax.model.attention import causal_attention, causal_attention_reference
from dagmoe_jax.model.settle import settle_attention


@pytest.mark.parametrize("segmented", [False, True], ids=["causal", "segments"])
def test_triton_attention_equals_the_reference(segmented):
    b, s, h, kv, d = 2, 256, 4, 2, 32
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d))
    k = jax.random.normal(keys[1], (b, s, kv, d))
    v = jax.random.normal(keys[2], (b, s, kv, d))
    probe = jax.random.normal(keys[3], (b, s, h, d))
    seg = (jnp.asarray(np.repeat([[0] * 100 + [1] * 130 + [2] * 26], b, 0), jnp.int32)
           if segmented else None)
    kernel = functools.partial(triton_causal_attention, segment_ids=seg, interpret=True)
    reference = functools.partial(causal_attention_reference, segment_ids=seg)
    np.testing.assert_allclose(kernel(q, k, v), reference(q, k, v), atol=1e-5)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a) * probe)  # noqa: E731
    grads = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-5, err_msg=name)


def test_triton_attention_takes_128_blocks_and_one_device():
    assert triton_attention_supported(1024) and not triton_attention_supported(100)
    x = jnp.zeros((1, 100, 2, 16))
    with pytest.raises(ValueError, match="multiple of 128"):
        triton_causal_attention(x, x, x)
    # a sampling prompt of another length runs XLA's attention through the model's dispatcher
    np.testing.assert_allclose(causal_attention(x, x, x, "triton", 64), 0.0)
    assert settle_attention("triton", "gpu", jnp.dtype(jnp.bfloat16), 64, None) == ("triton", "")
    with pytest.raises(ValueError, match="single device"):
        settle_attention("triton", "gpu", jnp.dtype(jnp.bfloat16), 64, object())
