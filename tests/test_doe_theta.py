"""DoE's theta reading of the first layer's VAE input (``DoEConfig.first_input='theta'``,
docs/design.md section 6): the mixture theta(<t)^T E_know against NumPy, its causality end to end,
its gradient into E_know, and KV-cache generation equal to the full forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dagmoe_jax.families.doe.config import DoEConfig
from dagmoe_jax.data.tokenizers import ByteTokenizer
from dagmoe_jax.decoding.generate import generate
from dagmoe_jax.families.doe import block as D
from dagmoe_jax.families.doe.extension import TopicFeatures
from dagmoe_jax.families.doe.topics import piece_table, token_topics
from dagmoe_jax.model.accounting import account
from dagmoe_jax.train.step import lm_loss
from conftest import make_model, tiny_config
from test_doe import DOE, K, doe_config, lda  # noqa: F401  (lda: the module's fitted topic fixture)


def mixture_numpy(topics, embed):
    """theta_t = histogram of the ids at positions j <= t over K + 1 ids, / (t + 1); theta E."""
    b, s = topics.shape
    out = np.zeros((b, s, embed.shape[1]))
    for r in range(b):
        for t in range(s):
            theta = np.bincount(topics[r, :t + 1], minlength=embed.shape[0]) / (t + 1)
            out[r, t] = theta @ embed
    return out


def test_mixture_matches_numpy_and_given_counts(rng):
    topics = rng.integers(0, K + 1, (3, 11))
    embed = rng.normal(size=(K + 1, 6))
    want = mixture_numpy(topics, embed)
    got = D.causal_topic_mixture(jnp.asarray(topics), jnp.asarray(embed, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    counts = np.cumsum(np.eye(K + 1, dtype=np.int32)[topics], axis=1)    # the decoding input
    got = D.causal_topic_mixture(jnp.asarray(topics), jnp.asarray(embed, jnp.float32),
                                 jnp.asarray(counts))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # one id everywhere: the mixture is that id's embedding, the default reading's input
    same = np.full((1, 5), 3)
    np.testing.assert_allclose(D.causal_topic_mixture(jnp.asarray(same), jnp.asarray(embed)),
                               np.broadcast_to(embed[3], (1, 5, 6)), rtol=1e-6)


def test_gradient_reaches_every_seen_row_of_e_know(rng):
    topics = jnp.asarray([[2, 2, 5, K, 2]])
    embed = jnp.asarray(rng.normal(size=(K + 1, 4)), jnp.float32)
    w = rng.normal(size=(1, 5, 4))
    g = jax.grad(lambda e: jnp.sum(D.causal_topic_mixture(topics, e) * w))(embed)
    theta = np.stack([np.bincount(np.asarray(topics[0, :t + 1]), minlength=K + 1) / (t + 1)
                      for t in range(5)])
    np.testing.assert_allclose(g, theta.T @ w[0], rtol=1e-5, atol=1e-6)   # d/dE = theta^T w
    assert set(np.flatnonzero(np.abs(np.asarray(g)).sum(1))) == {2, 5, K}

    # end to end: the language-model loss reaches E_know, and through the theta path too
    cfg = doe_config(layers=2, first_input="theta")
    model = make_model(cfg)
    tokens = rng.integers(0, 256, (2, 13))
    ids = rng.integers(0, K + 1, (2, 12))
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
             "topics": jnp.asarray(ids, jnp.int32), "topic_labels": jnp.asarray(ids % K)}
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.jit(jax.grad(lambda p: lm_loss(nnx.merge(graph, p, rest), batch)[0]))(params)
    g_know = np.asarray(grads["doe"]["topic_embed"][...])
    assert np.all(np.isfinite(g_know)) and np.abs(g_know).max() > 0
    shared = model.doe
    term = lambda e: jnp.sum(D.causal_topic_mixture(batch["topics"], e) @ shared.w_t[...])
    assert np.abs(np.asarray(jax.grad(term)(shared.topic_embed[...]))).max() > 0


def test_first_layer_topic_term_is_the_mixture(rng):
    """DoEShared.prepare feeds the first layer's VAE theta(<t)^T E_know W_t, and the dual-input
    embedding keeps the id (Algorithm 1)."""
    ids = rng.integers(0, K + 1, (2, 7))
    tokens = jnp.asarray(rng.integers(0, 256, (2, 7)))
    outs = {}
    emb = jnp.asarray(rng.normal(size=(256, doe_config().d_model)), jnp.float32)
    for reading in ("topic_id", "theta"):
        cfg = doe_config(first_input=reading)
        shared = D.DoEShared(cfg, rngs=nnx.Rngs(0))
        h, _, inputs = shared.prepare(tokens, emb[tokens], emb, {"topics": jnp.asarray(ids)},
                                      None, decoding=False)
        outs[reading] = (np.asarray(h), np.asarray(inputs.topic_term))
        e, w_t = np.asarray(shared.topic_embed[...]), np.asarray(shared.w_t[...])
    np.testing.assert_allclose(outs["theta"][1], mixture_numpy(ids, e) @ w_t, rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(outs["topic_id"][1], e[ids] @ w_t, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(outs["theta"][0], outs["topic_id"][0])


def theta_model(rng, seed=1):
    """A theta-reading model with weights large enough that the first layer's VAE topic term
    moves the logits well above float32 noise: at the usual initialisation (std 0.02 through
    the VAE, the gate, Z and the FFN) a wrong theta changes them by ~1e-8, and W_in's topic
    half starts at zero."""
    cfg = tiny_config("doe", num_layers=3, vocab_size=256, init_std=0.2,
                      doe={**DOE, "first_input": "theta"})
    model = make_model(cfg, seed=seed)
    p = model.doe.w_in
    p[...] = jnp.asarray(rng.normal(size=p.shape) * 0.3, p[...].dtype)
    return model


def test_theta_is_causal_end_to_end(rng):
    """Changing the topic id at position t changes no logit before t, and changes every one
    from t on."""
    model = theta_model(rng)
    forward = nnx.jit(lambda m, tok, top: m(tok, features={"topics": top})[0])
    tokens = jnp.asarray(np.tile(rng.integers(0, 256, (1, 16)), (2, 1)))
    ids = np.tile(rng.integers(0, K, (1, 16)), (2, 1))
    t = 9
    ids[1, t] = (ids[0, t] + 1) % K
    logits = np.asarray(forward(model, tokens, jnp.asarray(ids)))
    np.testing.assert_allclose(logits[0, :t], logits[1, :t], rtol=1e-6, atol=1e-6)
    assert np.all(np.abs(logits[0, t:] - logits[1, t:]).max(-1) > 1e-4)
    # the VAE input itself: positions after t see the changed id in their theta
    mix = np.asarray(D.causal_topic_mixture(jnp.asarray(ids), model.doe.topic_embed[...]))
    np.testing.assert_array_equal(mix[0, :t], mix[1, :t])
    assert np.all(np.abs(mix[0, t:] - mix[1, t:]).max(-1) > 0)


def test_kv_cache_generation_equals_the_full_forward_pass(lda, rng):  # noqa: F811
    """Greedy KV-cache generation (topic ids and their running counts tracked on the host,
    prompts of different lengths) continues each prompt with exactly the tokens the full
    forward pass ranks first; a decode step's logits equal the full pass's, and would not
    with the step's own counts alone (the history matters)."""
    pieces = piece_table(ByteTokenizer())
    texts = (b"ocean wave salt tide, flame ember smoke ash heat reef tide!",
             b"flame ash heat heat, ocean reef tide salt wave wave ember!!")
    model = theta_model(rng)
    forward = nnx.jit(lambda m, tok, top: m(tok, features={"topics": top})[0])
    prompts = [list(texts[0][:24]), list(texts[1][:19])]
    tracker = TopicFeatures(lda, pieces, counts=True)
    gen = generate(model, prompts, max_new_tokens=20, features=tracker)
    for r in range(2):
        full = prompts[r] + gen[r]
        top = jnp.asarray(token_topics(lda, full, pieces)[0])[None]
        ranked = np.asarray(forward(model, jnp.asarray([full]), top)).argmax(-1)[0]
        np.testing.assert_array_equal(ranked[len(prompts[r]) - 1:-1], gen[r])
    # the carried counts are the histogram of every id so far
    ids = [token_topics(lda, prompts[r] + gen[r], pieces)[0] for r in range(2)]
    np.testing.assert_array_equal(tracker.running[0], np.bincount(ids[0][:-1], minlength=K + 1))

    # one prefill + decode step by hand, right-padded prompts, against the full pass's logits
    full = prompts[0] + gen[0][:2]                       # row 0: 26 tokens, row 1: 21
    rows = [full, prompts[1] + gen[1][:2]]
    lengths = np.array([len(r) - 1 for r in rows])
    padded = np.zeros((2, lengths.max()), np.int64)
    for r in range(2):
        padded[r, :lengths[r]] = rows[r][:-1]
    tracker = TopicFeatures(lda, pieces, counts=True)
    feats = {k: jnp.asarray(v) for k, v in tracker.prompt(padded, lengths).items()}
    _, aux = model(jnp.asarray(padded), features=feats, cache=model.init_cache(2, 32))
    last = np.array([r[-1] for r in rows])
    step = {k: jnp.asarray(v) for k, v in tracker.step(last).items()}
    got, _ = model(jnp.asarray(last)[:, None], features=step, cache=aux["cache"],
                   start=jnp.asarray(lengths))
    alone = dict(step, topic_counts=jnp.asarray(np.eye(K + 1, dtype=np.int32)[
        np.asarray(step["topics"])]))
    wrong, _ = model(jnp.asarray(last)[:, None], features=alone, cache=aux["cache"],
                     start=jnp.asarray(lengths))
    for r in range(2):
        top = jnp.asarray(token_topics(lda, rows[r], pieces)[0])[None]
        want = np.asarray(forward(model, jnp.asarray([rows[r]]), top))[0, -1]
        np.testing.assert_allclose(got[r, 0], want, rtol=1e-4, atol=1e-4)
        assert np.abs(np.asarray(wrong[r, 0]) - want).max() > 1e-3


def test_theta_decoding_without_counts_and_config_errors(rng):
    cfg = doe_config(first_input="theta")
    model = make_model(cfg)
    tokens = jnp.zeros((1, 4), jnp.int32)
    topics = {"topics": jnp.full((1, 4), K, jnp.int32)}
    with pytest.raises(ValueError, match=r"first_input='theta' decodes over a KV cache only"):
        model(tokens, features=topics, cache=model.init_cache(1, 8))
    bad = dict(topics, topic_counts=jnp.zeros((1, 4, K), jnp.int32))
    with pytest.raises(ValueError, match="topic_counts has shape"):
        model(tokens, features=bad, cache=model.init_cache(1, 8))
    with pytest.raises(ValueError, match="DoEConfig.first_input"):
        DoEConfig(first_input="dist")
    with pytest.raises(ValueError, match="DoEConfig.first_input"):
        DoEConfig(use_topics=False, alpha=0.0, first_input="theta")
    flops = lambda reading: account(doe_config(first_input=reading)).flops["doe_embedding"]
    assert flops("theta") - flops("topic_id") == 3.0 * 2.0 * (K + 1) * 8
    assert (account(doe_config(first_input="theta")).total_params
            == account(doe_config()).total_params)
