"""Packed sequences (segment ids, docs/design.md section 1): RoPE positions restart per example,
every attention implementation keeps attention inside each example (values and gradients), the
whole model gives a packed example the logits it gets alone, segment_ids=None is unchanged, the
training step carries a batch's "segment_ids", decoding refuses them, and the segment-masked XLA
and cuDNN attention lower for CUDA."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from conftest import make_model, tiny_config
from dagmoe_jax.kernels import build as kbuild
from dagmoe_jax.kernels import pallas
from dagmoe_jax.model.attention import (blockwise_causal_attention, causal_attention,
                                        causal_attention_reference, sharded_splash_attention)
from dagmoe_jax.model.segments import segment_mask, segment_positions
from dagmoe_jax.parallel import MeshConfig, activate, make_mesh
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.run.state import device_batch
from dagmoe_jax.train.step import lm_loss

from test_model import randomize_zero_inits

needs_compiler = pytest.mark.skipif(kbuild.compiler() is None,
                                    reason="no C++ compiler: the fused kernel cannot be built")


def np_positions(seg: np.ndarray) -> np.ndarray:
    """NumPy transcription: position = index - index of the first token of its segment run."""
    out = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        start = 0
        for i in range(seg.shape[1]):
            if i > 0 and seg[b, i] != seg[b, i - 1]:
                start = i
            out[b, i] = i - start
    return out


def packed_layout(lengths, total: int) -> np.ndarray:
    """Segment ids [total]: example e (ids 1, 2, ...) of lengths[e], then padding (0)."""
    ids = np.concatenate([np.full(n, e + 1) for e, n in enumerate(lengths)])
    return np.concatenate([ids, np.zeros(total - len(ids))]).astype(np.int32)


def spans(seg_row: np.ndarray):
    """(start, stop) of each nonzero segment of a row."""
    return [(int(np.argmax(seg_row == i)), int(np.argmax(seg_row == i)) + int(np.sum(seg_row == i)))
            for i in np.unique(seg_row) if i != 0]


def test_segment_positions_restart_at_each_example():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(6):
        lengths = rng.integers(1, 9, size=rng.integers(1, 5))
        rows.append(packed_layout(lengths, 40))
    rows.append(np.ones(40, np.int32))                  # one example: 0..S-1
    rows.append(np.array([3, 3, 7, 7, 7, 3, 3] + [0] * 33, np.int32))   # reused id: a new run
    seg = np.stack(rows)
    got = np.asarray(jax.jit(segment_positions)(seg))
    np.testing.assert_array_equal(got, np_positions(seg))
    np.testing.assert_array_equal(got[-2], np.arange(40))
    mask = np.asarray(segment_mask(seg[:1]))[0]
    i, j = np.meshgrid(np.arange(40), np.arange(40), indexing="ij")
    np.testing.assert_array_equal(mask, (j <= i) & (seg[0][:, None] == seg[0][None, :]))


def random_qkv(seed, b, s, h=4, kv=2, d=16):
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, s, h, d)), jax.random.normal(kk, (b, s, kv, d)),
            jax.random.normal(kv_, (b, s, kv, d)))


IMPLS = {
    "reference": causal_attention_reference,
    "blockwise": lambda q, k, v, seg=None: blockwise_causal_attention(q, k, v, 8, seg),
    "fused": lambda q, k, v, seg=None: causal_attention(q, k, v, "fused", 8, None, seg),
    "xla": lambda q, k, v, seg=None: causal_attention(q, k, v, "xla", 8, None, seg),
}


def check_packed_equals_alone(fn, q, k, v, seg, atol=2e-6):
    """Each example of the packed rows equals the reference on it alone; padding is finite."""
    out = np.asarray(jax.jit(fn)(q, k, v, jnp.asarray(seg)))
    assert np.all(np.isfinite(out))
    for b in range(seg.shape[0]):
        for start, stop in spans(seg[b]):
            sl = (slice(b, b + 1), slice(start, stop))
            alone = causal_attention_reference(q[sl], k[sl], v[sl])
            np.testing.assert_allclose(out[sl], np.asarray(alone), rtol=1e-5, atol=atol,
                                       err_msg=f"row {b} segment [{start}, {stop})")


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_compiler if n == "fused" else ())
                                  for n in IMPLS])
def test_packed_attention_equals_each_example_alone(name):
    fn = IMPLS[name]
    # 45 positions: segments across the 16-key tiles and 8-position blocks, trailing padding,
    # an example of one token, and a row of one example
    seg = np.stack([packed_layout([20, 17, 1, 4], 45), packed_layout([3, 39], 45),
                    np.ones(45, np.int32)])
    q, k, v = random_qkv(1, 3, 45)
    check_packed_equals_alone(fn, q, k, v, seg)
    # all-ones segment ids: the unsegmented result
    ones = jnp.ones((3, 45), jnp.int32)
    np.testing.assert_allclose(np.asarray(fn(q, k, v, ones)), np.asarray(fn(q, k, v)),
                               rtol=1e-6, atol=1e-6)


@needs_compiler
def test_fused_gradients_with_segments_match_the_reference():
    seg = jnp.asarray(np.stack([packed_layout([20, 17, 1, 4], 45), packed_layout([3, 39], 45)]))
    q, k, v = random_qkv(2, 2, 45, h=6, kv=3, d=32)
    cot = jax.random.normal(jax.random.key(7), q.shape)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg) * cot),
                                argnums=(0, 1, 2)))(q, k, v)

    fused = grads(lambda q, k, v, s: causal_attention(q, k, v, "fused", 8, None, s))
    ref = grads(causal_attention_reference)
    block = grads(lambda q, k, v, s: blockwise_causal_attention(q, k, v, 8, s))
    for name, a, r, bl in zip("qkv", fused, ref, block):
        scale = float(np.max(np.abs(np.asarray(r))))
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6 * scale,
                                   err_msg=f"d{name}")
        np.testing.assert_allclose(np.asarray(bl), np.asarray(r), rtol=1e-5,
                                   atol=1e-6 * scale, err_msg=f"d{name} blockwise")
    # no gradient crosses an example: a loss on example 1 leaves example 2's keys untouched
    dk = jax.grad(lambda k: jnp.sum(causal_attention(q, k, v, "fused", 8, None, seg)[0, :20]))(k)
    assert np.all(np.asarray(dk)[0, 20:] == 0) and np.any(np.asarray(dk)[0, :20] != 0)


def test_splash_with_segments_interpret_mode_and_sharded():
    seg = np.stack([packed_layout([50, 60, 10], 128), packed_layout([128], 128)])
    q, k, v = random_qkv(3, 2, 128)
    splash = functools.partial(pallas.splash_causal_attention, interpret=True)
    check_packed_equals_alone(lambda q, k, v, s: splash(q, k, v, segment_ids=s), q, k, v, seg,
                              atol=1e-5)
    mesh = make_mesh(MeshConfig(data=2), jax.devices()[:2])
    layout = MeshLayout.of(mesh)
    with activate(mesh):
        check_packed_equals_alone(
            lambda q, k, v, s: sharded_splash_attention(q, k, v, layout, s, interpret=True),
            q, k, v, seg, atol=1e-5)


# capacity_factor = num_experts: capacity dispatch never drops a token, so routing does not
# couple the tokens of a batch (tests/test_model.py NO_DROP)
MODELS = {
    "dense": tiny_config("dense"),
    "moe-dag": tiny_config("moe", "dag", experts=dict(capacity_factor=4.0)),
    "moe-dag-blockwise": tiny_config("moe", "dag", experts=dict(capacity_factor=4.0)),
}
ATTENTION = {"moe-dag-blockwise": "blockwise"}       # else 'auto': fused on CPU when it builds


@functools.lru_cache(maxsize=None)
def model_of(name):
    model = make_model(MODELS[name], **({"attention": ATTENTION[name]} if name in ATTENTION
                                        else {}))
    randomize_zero_inits(model)
    return model


@nnx.jit
def forward(model, tokens, segment_ids):
    return model(tokens, segment_ids=segment_ids)[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_model_logits_equal_each_example_alone(name):
    model = model_of(name)
    lengths, total = [5, 7, 3], 16
    seg = packed_layout(lengths, total)[None]                  # [ex1, ex2, ex3, padding]
    tokens = jax.random.randint(jax.random.key(1), (1, total), 1, 64)
    packed = np.asarray(forward(model, tokens, jnp.asarray(seg)))
    assert np.all(np.isfinite(packed))
    # each example alone, at positions from 0, right-padded to one shape (causal: the padding
    # after an example changes nothing before it)
    alone_tokens = np.zeros((len(lengths), total), np.int32)
    for e, (start, stop) in enumerate(spans(seg[0])):
        alone_tokens[e, :stop - start] = np.asarray(tokens)[0, start:stop]
    alone = np.asarray(forward(model, jnp.asarray(alone_tokens), None))
    for e, (start, stop) in enumerate(spans(seg[0])):
        np.testing.assert_allclose(packed[0, start:stop], alone[e, :stop - start], rtol=1e-5,
                                   atol=1e-5, err_msg=f"example {e}")
    # all-ones segment ids: the logits without segment ids
    plain = np.asarray(forward(model, tokens, None))
    ones = np.asarray(forward(model, tokens, jnp.ones((1, total), jnp.int32)))
    np.testing.assert_allclose(ones, plain, rtol=1e-6, atol=1e-6)


def test_no_segments_is_the_unsegmented_program():
    """segment_ids=None traces none of the segment code: no segmented kernel, no cummax."""
    model = model_of("moe-dag")
    tokens = jnp.zeros((1, 16), jnp.int32)
    graphdef, state = nnx.split(model)
    plain = str(jax.make_jaxpr(lambda st, t: nnx.merge(graphdef, st)(t)[0])(state, tokens))
    packed = str(jax.make_jaxpr(lambda st, t: nnx.merge(graphdef, st)(
        t, segment_ids=jnp.ones_like(t))[0])(state, tokens))
    assert "segmented" not in plain and "cummax" not in plain
    assert "segmented" in packed and "cummax" in packed


def test_lm_loss_with_segments_trains_and_decoding_refuses_them():
    model = model_of("moe-dag")
    seg = np.stack([packed_layout([5, 7, 3], 16), packed_layout([16], 16)])
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 17), 1, 64), np.int32)
    host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": seg > 0,
            "segment_ids": seg, "task": np.zeros(2)}
    batch = device_batch(host)
    assert sorted(batch) == ["inputs", "mask", "segment_ids", "targets"]
    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(lm_loss, has_aux=True))(model, batch)
    no_seg, _ = nnx.jit(lm_loss)(model, {k: v for k, v in batch.items() if k != "segment_ids"})
    assert np.isfinite(float(loss)) and float(loss) != float(no_seg)
    leaves = jax.tree.leaves(nnx.state(grads))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
    assert sum(float(jnp.sum(jnp.abs(g))) for g in leaves) > 0
    with pytest.raises(ValueError, match="segment_ids .* decoding with a KV cache"):
        model(jnp.asarray(tokens[:, :8]), cache=model.init_cache(2, 16),
              segment_ids=jnp.ones((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="one segment id per token"):
        model(jnp.asarray(tokens[:, :8]), segment_ids=jnp.ones((2, 7), jnp.int32))


CUDNN_CALLS = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")


@pytest.mark.parametrize("impl,platform", [("xla", "cuda"), ("cudnn", "cuda"), ("splash", "tpu")])
def test_segment_masked_attention_lowers_for_accelerators(impl, platform, monkeypatch):
    """The training direction (forward and gradients) of the segmented attention lowers for
    the accelerator it is settled on (jax.export). JAX's cuDNN attention asks the installed
    cuDNN its version while lowering; that question alone is answered here (9.10), so the rest
    of the lowering (the mask as cuDNN's additive bias beside its causal mask) is real. Splash
    lowers its segmented Mosaic kernels."""
    if impl == "cudnn":
        fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
        if not hasattr(fa, "check_cudnn_version"):
            pytest.skip("this JAX's cuDNN attention has no check_cudnn_version to answer")
        monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 128), jnp.int32)

    def loss(q, k, v, s):
        return jnp.sum(causal_attention(q, k, v, impl, 128, None, s).astype(jnp.float32))

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    checks = [export.DisabledSafetyCheck.custom_call(c) for c in CUDNN_CALLS]
    module = export.export(fn, platforms=(platform,), disabled_checks=checks)(
        q, k, k, seg).mlir_module()
    if impl == "cudnn":
        assert all(f"@{c}(" in module for c in CUDNN_CALLS)
        assert "tensor<2x1x128x128xbf16>" in module                    # the segment bias
    elif impl == "splash":
        kernels = set(re.findall(r'kernel_name\s*=\s*"([^"]+)"', module))
        for part in ("fwd", "dq", "dkv"):
            assert any(k.startswith(f"splash_mha_{part}_segmented") for k in kernels), kernels
    else:
        assert "cudnn" not in module and "custom_call" not in module
