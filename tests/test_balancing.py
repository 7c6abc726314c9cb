"""Routing the field trains with (issue 50, item 3): the per-sequence balance loss.

* ``RouterConfig.balance_scope='sequence'``: DeepSeek-V2's expert-level / DeepSeek-V3's
  sequence-wise balance loss, f_i and P_i counted within each row of the batch and the loss
  averaged over rows; checked against a NumPy transcription of DeepSeek's ``MoEGate.forward``
  ``seq_aux`` branch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.config import RouterConfig
from dagmoe_jax.model.router import Router, balance_loss, balance_probs, sequence_balance_loss


def np_seq_aux(scores, topk_idx, bsz, n, k):
    """DeepSeek's ``MoEGate.forward``, ``seq_aux`` branch (modeling_deepseek.py of
    deepseek-ai/DeepSeek-V2), in NumPy, without ``alpha``: ce[b, i] = expert i's count among row
    b's S * K assignments / (S * K / N); loss = mean_b sum_i ce[b, i] * mean_t scores[b, t, i]."""
    seq_len = scores.shape[0] // bsz
    idx = topk_idx.reshape(bsz, -1)
    ce = np.zeros((bsz, n))
    for b in range(bsz):
        np.add.at(ce[b], idx[b], 1.0)
    ce /= seq_len * k / n
    return (ce * scores.reshape(bsz, seq_len, n).mean(axis=1)).sum(axis=1).mean()


def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@nnx.jit
def forward(model, tokens):
    return model(tokens)


def batch_of(cfg, rows=4, length=12, seed=0):
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (rows, length + 1))
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


# ---------------------------------------------------------------- per-sequence balance loss

@pytest.mark.parametrize("load", ["slots", "tokens"])
def test_sequence_balance_loss_is_deepseeks_seq_aux(load):
    rng = np.random.default_rng(0)
    bsz, seq_len, n, k = 3, 10, 6, 2
    logits = rng.normal(size=(bsz * seq_len, n)).astype(np.float32)
    scores = np_softmax(logits.astype(np.float64))
    _, idx = jax.lax.top_k(jnp.asarray(scores), k)
    want = np_seq_aux(scores, np.asarray(idx), bsz, n, k) * (k if load == "tokens" else 1)
    probs = balance_probs(jnp.asarray(logits), jnp.asarray(scores, jnp.float32), "softmax")
    got = sequence_balance_loss(probs, idx, bsz, load)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    # ... and through the router: softmax scores, the 'slots' convention, 'sequence' scope
    cfg = RouterConfig(score_fn="softmax", top_k=k, balance_load=load, balance_scope="sequence")
    router = Router(cfg, 8, n, std=0.5, rngs=nnx.Rngs(1))
    x = jnp.asarray(rng.normal(size=(bsz * seq_len, 8)), jnp.float32)
    routing = router(x)
    s = np.asarray(routing.scores, np.float64)
    want = np_seq_aux(s, np.asarray(routing.indices), bsz, n, k) * (k if load == "tokens" else 1)
    np.testing.assert_allclose(float(router.losses(routing, sequences=bsz)["balance_loss"]),
                               want, rtol=1e-5)


def test_one_sequence_is_the_batch_loss_and_rows_differ():
    rng = np.random.default_rng(1)
    for load in ("tokens", "slots"):
        probs = jnp.asarray(np_softmax(rng.normal(size=(16, 5))), jnp.float32)
        idx = jax.lax.top_k(probs, 2)[1]
        np.testing.assert_allclose(float(sequence_balance_loss(probs, idx, 1, load)),
                                   float(balance_loss(probs, idx, load)), rtol=1e-6)
    # two rows each routed to their own two experts: balanced over the batch, not per row
    probs = jnp.asarray(np.repeat(np.eye(4)[[0, 2]], 8, axis=0) * 0.5
                        + np.repeat(np.eye(4)[[1, 3]], 8, axis=0) * 0.5, jnp.float32)
    idx = jnp.asarray(np.repeat([[0, 1], [2, 3]], 8, axis=0))
    assert float(balance_loss(probs, idx, "slots")) == pytest.approx(1.0)   # balanced
    assert float(sequence_balance_loss(probs, idx, 2, "slots")) == pytest.approx(2.0)


def test_sequence_scope_in_the_model():
    """The MoE block passes its B rows as the sequences: B equal rows give the batch loss (each
    row's f and P are the batch's), different rows another; the scope changes the loss only,
    never the outputs."""
    batch = tiny_config("moe", "sum")
    seq = tiny_config("moe", "sum", router={"balance_scope": "sequence"})
    tokens = batch_of(batch)["inputs"]
    model_b, model_s = make_model(batch), make_model(seq)
    (lb, ab), (ls, as_) = forward(model_b, tokens), forward(model_s, tokens)
    np.testing.assert_array_equal(np.asarray(lb), np.asarray(ls))
    assert float(ab["balance_loss"]) != pytest.approx(float(as_["balance_loss"]), rel=1e-4)
    same = jnp.repeat(tokens[:1], tokens.shape[0], axis=0)
    _, one_b = forward(model_b, same)
    _, one_s = forward(model_s, same)
    np.testing.assert_allclose(float(one_s["balance_loss"]), float(one_b["balance_loss"]),
                               rtol=1e-6)


def test_config_errors():
    with pytest.raises(ValueError, match="RouterConfig.balance_scope"):
        RouterConfig(balance_scope="row")
    assert dataclasses.asdict(RouterConfig())["balance_scope"] == "batch"
