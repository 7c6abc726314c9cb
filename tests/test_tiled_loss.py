"""The vocabulary-tiled cross-entropy equals the plain one, loss and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.train.step import cross_entropy, lm_loss
from dagmoe_jax.model.tiled_loss import tiled_cross_entropy


def numpy_cross_entropy(h, w, targets, mask):
    """The plain transcription: mean over masked positions of logsumexp(hW) - (hW)[target]."""
    logits = np.einsum("bsd,dv->bsv", h.astype(np.float64), w.astype(np.float64))
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float(((lse - picked) * mask).sum() / max(mask.sum(), 1.0))


@pytest.mark.parametrize("seq, chunk_tokens", [(12, 8), (12, 12), (7, 4)])
def test_tiled_equals_plain_loss_and_gradients(rng, seq, chunk_tokens):
    # chunk 8 tokens over 2 rows: 4 positions, 3 chunks; 12: one chunk of 6 positions, 2
    # chunks; seq 7 with 2-position chunks: padded to 8 (the padding carries no weight)
    b, d, v = 2, 8, 37
    h = jnp.asarray(rng.normal(size=(b, seq, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, seq)), jnp.int32)
    mask = jnp.asarray(rng.random((b, seq)) < 0.8)

    def plain(h, w):
        return cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), targets, mask)

    def tiled(h, w):
        return tiled_cross_entropy(h, w, targets, mask, chunk_tokens)

    loss, (gh, gw) = jax.value_and_grad(tiled, argnums=(0, 1))(h, w)
    ref, (rh, rw) = jax.value_and_grad(plain, argnums=(0, 1))(h, w)
    np.testing.assert_allclose(loss, numpy_cross_entropy(np.asarray(h), np.asarray(w),
                                                         np.asarray(targets), np.asarray(mask)),
                               rtol=1e-5)
    np.testing.assert_allclose(jax.jit(tiled)(h, w), ref, rtol=1e-5)      # primal, no VJP
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    np.testing.assert_allclose(gh, rh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-7)
    # a masked position gets no gradient
    assert np.all(np.asarray(gh)[~np.asarray(mask)] == 0)


def test_training_loss_matches_logits_path():
    """lm_loss (hidden states + tiled head) gives the loss and parameter gradients of the plain
    loss on the model's own logits."""
    cfg = tiny_config("moe")
    model = make_model(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": jnp.arange(16)[None, :] < jnp.array([[16], [11]])}

    def plain(m):
        logits, aux = m(batch["inputs"])
        return cross_entropy(logits, batch["targets"], batch["mask"]) + aux["aux_loss"]

    @nnx.jit
    def both(m):
        (loss, metrics), grads = nnx.value_and_grad(lm_loss, has_aux=True)(m, batch)
        ref, ref_grads = nnx.value_and_grad(plain)(m)
        return loss, metrics, grads, ref, ref_grads

    loss, metrics, grads, ref, ref_grads = both(model)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    logits, _ = model(batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    np.testing.assert_allclose(metrics["ce_loss"], jnp.sum(losses * batch["mask"]) / 27, rtol=1e-5)
    flat, ref_flat = nnx.to_flat_state(grads), dict(nnx.to_flat_state(ref_grads))
    for path, g in flat:
        np.testing.assert_allclose(g[...], ref_flat[path][...], rtol=1e-4, atol=1e-6,
                                   err_msg=str(path))
    assert float(jnp.max(jnp.abs(dict(flat)[("lm_head",)][...]))) > 0


def test_bfloat16_inputs_accumulate_in_float32(rng):
    """bfloat16 hidden states and head (the accelerator default): the loss and gradients match
    the plain loss over float32-accumulated logits of the same bfloat16 inputs."""
    b, s, d, v = 2, 16, 32, 300
    h = jnp.asarray(rng.normal(size=(b, s, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.2, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    mask = jnp.ones((b, s), bool)

    def plain(h, w):
        logits = jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=jnp.float32)
        return cross_entropy(logits, targets, mask)

    tiled = lambda h, w: tiled_cross_entropy(h, w, targets, mask, 8)  # noqa: E731
    (loss, grads), (ref, ref_grads) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)
                                       for f in (tiled, plain))
    assert loss.dtype == jnp.float32 and grads[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("seq", [16, 13])                 # 13: positions padded to the chunk
def test_tiled_scores_equal_the_whole_logits(rng, seq):
    """Evaluation's per-position loss and argmax, a chunk at a time, equal optax's loss and
    the argmax of the whole logits (a tied pair of logits included: the lower id wins)."""
    from dagmoe_jax.model.tiled_loss import tiled_scores

    b, d, v = 3, 8, 50
    h = jnp.asarray(rng.standard_normal((b, seq, d)), jnp.float32)
    w = np.asarray(rng.standard_normal((d, v)), np.float32)
    w[:, 7] = w[:, 3]                                      # ids 3 and 7 always tie
    w = jnp.asarray(w)
    targets = jnp.asarray(rng.integers(0, v, (b, seq)), jnp.int32)
    losses, predictions = jax.jit(tiled_scores, static_argnums=3)(h, w, targets, 8)
    logits = np.asarray(h) @ np.asarray(w)
    want = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), targets)
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(predictions, np.argmax(logits, axis=-1))
    assert predictions.dtype == jnp.int32 and not np.any(np.asarray(predictions) == 7)


def test_eval_step_matches_the_model_logits():
    from dagmoe_jax.evaluation import eval_step

    cfg = tiny_config("moe", "dag")
    model = make_model(cfg)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    mask = jnp.arange(16)[None, :] < jnp.array([[16], [9]])
    out = eval_step(model, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask})
    logits, _ = model(tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    np.testing.assert_allclose(out["ce_sum"], jnp.sum(losses * mask), rtol=1e-5)
    assert float(out["tokens"]) == 25
    np.testing.assert_array_equal(out["predictions"], jnp.argmax(logits, axis=-1))


def _head_collectives_in_loops(fn, *args):
    """How many all-reduces and all-gathers as large as the whole LM head [d, V] (a dW or a
    gathered head) ``fn``'s compiled program runs inside a while loop's body (once per
    chunk)."""
    from dagmoe_jax.compile.hlo import attr, parse_module, shape_dims
    computations, _ = parse_module(jax.jit(fn).lower(*args).compile().as_text())
    bodies = {attr(i.attrs, "body").lstrip("%") for c in computations.values() for i in c
              if i.op == "while"}
    size = args[1].shape[0] * args[1].shape[1]
    return sum(1 for name in bodies for i in computations[name]
               if i.op.startswith(("all-reduce", "all-gather"))
               and int(np.prod(shape_dims(i.shape) or [0])) == size)


@pytest.mark.parametrize("mesh_cfg", [{"data": 8}, {"data": 2, "fsdp": 4},
                                      {"data": 2, "tensor": 4}])
def test_on_a_mesh_the_loss_and_gradients_equal_one_device_and_dw_is_summed_once(rng, mesh_cfg):
    """Under a mesh whose batch axes shard the rows, each device scans its own rows and the
    chunks' dW is summed across devices once, after the scan (not once per chunk, as the
    partitioner did with the sharded dW carry), reduce-scattered over ``fsdp``, which shards
    the head, and all-reduced over ``data``: loss and gradients equal the single-device ones;
    a vocabulary sharded over ``tensor`` keeps the global view, equal too."""
    from dagmoe_jax.parallel import MeshConfig, activate, make_mesh
    b, s, d, v = 8, 12, 16, 40
    h = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    mask = jnp.asarray(rng.random((b, s)) < 0.8)

    def loss(h, w):                                # 8 rows x 2 positions: 6 chunks
        return tiled_cross_entropy(h, w, targets, mask, chunk_tokens=16)

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    ref, (rh, rw) = jax.jit(grad)(h, w)
    with activate(make_mesh(MeshConfig(**mesh_cfg))):
        out, (gh, gw) = jax.jit(grad)(h, w)
        in_loops = _head_collectives_in_loops(grad, h, w)
        lowered = jax.jit(grad).lower(h, w).as_text()
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    np.testing.assert_allclose(gh, rh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-7)
    if "tensor" not in mesh_cfg:
        assert in_loops == 0
    # dW [16, 40] leaves the loss's shard_map as the fsdp shard of the head, [4, 40]
    scattered = "reduce_scatter" in lowered and "(tensor<16x40xf32>) -> tensor<4x40xf32>" in lowered
    assert scattered == ("fsdp" in mesh_cfg)
