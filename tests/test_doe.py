"""The DoE block (dagmoe_jax.families.doe.block): equations against NumPy, the VAE router's
properties, the shared VAE, causality with LDA topic ids, KV-cache decoding, and the composite
loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_model, tiny_config, tiny_execution
from dagmoe_jax.families.doe.config import DoEConfig
from dagmoe_jax.data.tokenizers import ByteTokenizer
from dagmoe_jax.decoding.generate import generate
from dagmoe_jax.families.doe import block as D
from dagmoe_jax.families.doe import objective
from dagmoe_jax.families.doe.extension import TopicFeatures
from dagmoe_jax.families.doe.topics import TopicConfig, fit_topics, piece_table, token_topics
from dagmoe_jax.train.step import cross_entropy, lm_loss

K = 8
DOE = dict(num_topics=K, topic_dim=8, vae_hidden=16, latent_dim=8)


def doe_config(layers: int = 3, **doe):
    """Three layers: the first layer's VAE, the shared middle one, the last layer's."""
    return tiny_config("doe", num_layers=layers, vocab_size=256, doe={**DOE, **doe})


def silu(x):
    return x / (1 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_knowledge_attention_eq2_matches_numpy(rng):
    q = rng.normal(size=(2, 5, 16)).astype(np.float32)
    z = rng.normal(size=(K, 16)).astype(np.float32)
    want = softmax(q @ z.T / np.sqrt(16)) @ z
    np.testing.assert_allclose(D.knowledge_attention(jnp.asarray(q), jnp.asarray(z)), want,
                               rtol=1e-5, atol=1e-6)


def test_dual_input_embedding_is_the_token_embedding_at_initialisation(rng):
    cfg = doe_config()
    shared = D.DoEShared(cfg, rngs=nnx.Rngs(0))
    tok = jnp.asarray(rng.normal(size=(2, 5, cfg.d_model)), jnp.float32)
    topic = shared.topic_embed[...][jnp.asarray(rng.integers(0, K + 1, (2, 5)))]
    assert float(jnp.abs(topic).max()) > 0
    np.testing.assert_array_equal(D.dual_input_embedding(tok, topic, shared.w_in[...]), tok)
    w = np.asarray(rng.normal(size=shared.w_in.shape), np.float32)      # Algorithm 1, any W_in
    want = np.concatenate([np.asarray(tok), np.asarray(topic)], -1) @ w
    np.testing.assert_allclose(D.dual_input_embedding(tok, topic, jnp.asarray(w)), want,
                               rtol=1e-5, atol=1e-6)


def test_kl_matches_the_gaussian_closed_form(rng):
    mu = rng.normal(size=(3, 6))
    logvar = rng.normal(size=(3, 6))
    # KL(N(m1, s1^2) || N(m2, s2^2)) = log(s2 / s1) + (s1^2 + (m1 - m2)^2) / (2 s2^2) - 1/2
    s1, m2, s2 = np.exp(0.5 * logvar), 0.0, 1.0
    want = np.sum(np.log(s2 / s1) + (s1 ** 2 + (mu - m2) ** 2) / (2 * s2 ** 2) - 0.5, axis=-1)
    got = D.kl_standard_normal(jnp.asarray(mu, jnp.float32), jnp.asarray(logvar, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def block_numpy(block, shared, x, signal, topic_term, index):
    """The whole DoE block with z = mu, transcribed in NumPy (eq. 1-3, 5, gates, A.1, H.2)."""
    p = lambda a: np.asarray(a[...], np.float64)
    zk = p(block.knowledge)
    h_enr = x + softmax((x @ p(block.w_q)) @ zk.T / np.sqrt(zk.shape[1])) @ zk
    v = {n: p(getattr(shared, f"vae_{n}"))[index] for n in D.VAE_NAMES}
    pre = h_enr @ v["w_h"] + signal @ v["w_s"] + v["b_e"] + (topic_term if index == 0 else 0)
    mu = silu(pre) @ v["w_mu"] + v["b_mu"]
    logits = mu @ p(block.w_g) + p(block.b_g)
    e_context = np.maximum(logits, 0) @ zk
    u = np.concatenate([h_enr, e_context], -1)
    return silu(u @ p(block.w_gate)) * (u @ p(block.w_up)) @ p(block.w_down), logits


@pytest.mark.parametrize("index", [0, 1])
def test_block_matches_numpy_and_evaluation_uses_the_mean(rng, index):
    cfg = doe_config(recon_coef=0.5)
    rngs = nnx.Rngs(0)
    block = D.DoEBlock(cfg, tiny_execution(cfg), rngs=rngs)
    shared = D.DoEShared(cfg, rngs=rngs)
    x = rng.normal(size=(2, 6, cfg.d_model)).astype(np.float32)
    signal = rng.normal(size=(2, 6, D.signal_dim(cfg))).astype(np.float32)
    topic_term = rng.normal(size=(2, 6, 16)).astype(np.float32)
    next_embed = rng.normal(size=(2, 6, cfg.d_model)).astype(np.float32)
    is_last = index == 1                    # the last layer's VAE decodes the next token's embedding
    layer = D.DoELayerInputs(jnp.int32(index), jnp.asarray(is_last))
    inputs = D.DoESharedInputs(shared.bank(), jnp.asarray(topic_term), jnp.asarray(next_embed))
    out, stats = block.apply(jnp.asarray(x), jnp.asarray(signal), layer, inputs)
    want, logits = block_numpy(block, shared, x.astype(np.float64), signal, topic_term, index)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(stats.extra.router_logits, logits, rtol=2e-4, atol=1e-6)
    # Reconstruction (eq. 7's likelihood term, squared error): from z = mu, of the next token's
    # embedding in the last layer, of H_enr elsewhere.
    p = lambda a: np.asarray(a[...], np.float64)
    zk = p(block.knowledge)
    h_enr = x + softmax((x @ p(block.w_q)) @ zk.T / np.sqrt(zk.shape[1])) @ zk
    v = {n: p(getattr(shared, f"vae_{n}"))[index] for n in D.VAE_NAMES}
    pre = h_enr @ v["w_h"] + signal @ v["w_s"] + v["b_e"] + (topic_term if index == 0 else 0)
    mu = silu(pre) @ v["w_mu"] + v["b_mu"]
    target = next_embed if is_last else h_enr
    want_recon = np.mean(np.sum((mu @ v["w_dec"] + v["b_dec"] - target) ** 2, -1))
    np.testing.assert_allclose(stats.extra.recon, want_recon, rtol=1e-4)
    noisy, noisy_stats = block.apply(jnp.asarray(x), jnp.asarray(signal),
                                     layer._replace(key=jax.random.key(3)), inputs)
    assert not np.allclose(noisy_stats.extra.router_logits, logits, atol=1e-6)


def test_relu_gates_zero_where_negative_and_block_gradient(rng):
    logits = jnp.asarray(rng.normal(size=(4, 5, K)), jnp.float32).at[..., 2].set(-1.0)
    z = jnp.asarray(rng.normal(size=(K, 6)), jnp.float32)
    gates = D.gate_values(logits, "relu")
    assert np.all(np.asarray(gates)[np.asarray(logits) < 0] == 0.0)
    assert np.all(np.asarray(gates)[np.asarray(logits) > 0] > 0.0)

    def f(lg, zz):
        return jnp.sum(jnp.sin(D.compose_expert(D.gate_values(lg, "relu"), zz)))

    g_logits, g_z = jax.grad(f, argnums=(0, 1))(logits, z)
    assert np.all(np.asarray(g_z)[2] == 0.0)          # row 2's gate is 0 on every token
    assert np.all(np.abs(np.asarray(g_z)[[0, 1, 3]]).sum(-1) > 0)
    assert np.all(np.asarray(g_logits)[np.asarray(logits) < 0] == 0.0)
    soft = D.gate_values(logits, "softmax")
    np.testing.assert_allclose(jnp.sum(soft, -1), 1.0, rtol=1e-6)


def test_expert_loss_masks_null_and_matches_numpy(rng):
    logits = rng.normal(size=(2, 7, K)).astype(np.float32)
    labels = rng.integers(0, K + 1, size=(2, 7))
    labels[0, 0], labels[1, 3] = K, K
    keep = labels != K
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, np.where(keep, labels, 0)[..., None], -1)[..., 0][keep].mean()
    got = objective.expert_loss(jnp.asarray(logits), jnp.asarray(labels), K)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert float(objective.expert_loss(jnp.asarray(logits), jnp.full((2, 7), K), K)) == 0.0


def test_shared_vae_exists_once():
    cfg = doe_config(layers=4)
    model = nnx.eval_shape(lambda: make_model(cfg))
    assert model.doe.vae_w_mu.shape[0] == 3                      # first, shared middle, last
    np.testing.assert_array_equal(D.vae_index(cfg), [0, 1, 1, 2])
    vae_params = [p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))
                  if any("vae_" in str(k) for k in p)]
    assert vae_params and all(p[0] == "doe" for p in vae_params)   # none inside the layers
    per_layer = doe_config(layers=4, vae_sharing="per_layer")
    assert nnx.eval_shape(lambda: make_model(per_layer)).doe.vae_w_mu.shape[0] == 4
    np.testing.assert_array_equal(D.vae_index(per_layer), [0, 1, 2, 3])


def test_config_and_input_errors():
    with pytest.raises(ValueError, match="DoEConfig.alpha"):
        DoEConfig(use_topics=False)
    with pytest.raises(ValueError, match="DoEConfig.gate"):
        DoEConfig(gate="sigmoid")
    with pytest.raises(ValueError, match=r"needs features=\{.topics.: \[B, S\]\}"):
        nnx.eval_shape(lambda: make_model(doe_config())(
            jnp.zeros((1, 4), jnp.int32)))


@pytest.fixture(scope="module")
def lda():
    words = [["ocean", "wave", "salt", "tide", "reef"], ["flame", "ember", "smoke", "ash", "heat"]]
    rng = np.random.default_rng(0)
    docs = [" ".join(words[d % 2][i] for i in rng.integers(0, 5, 30)) for d in range(40)]
    return fit_topics(docs, K, TopicConfig(max_iter=3, seed=0))


def test_causal_end_to_end_and_kv_cache_decoding(lda):
    pieces = piece_table(ByteTokenizer())
    text = b"ocean wave salt tide, flame ember smoke ash heat reef tide!"
    other = b"flame ash heat heat, ocean reef tide salt wave wave ember!!"
    cfg = doe_config()
    model = make_model(cfg, seed=1)
    forward = nnx.jit(lambda m, tok, top: m(tok, features={"topics": top})[0])
    t = 30
    rows, tops = [], []
    for data in (text, text[:t] + other[t:]):
        ids = list(data)
        rows.append(ids)
        tops.append(token_topics(lda, ids, pieces)[0])
    tokens, topics = jnp.asarray(rows), jnp.asarray(np.stack(tops))
    np.testing.assert_array_equal(topics[0, :t + 1], topics[1, :t + 1])
    assert not np.array_equal(topics[0], topics[1])
    logits = forward(model, tokens, topics)
    np.testing.assert_allclose(logits[0, :t], logits[1, :t], rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits[0, t:], logits[1, t:], atol=1e-4)

    # Greedy KV-cache generation with incremental topic tracking continues row 0's prompt with
    # exactly the tokens the full forward pass ranks first (teacher-forced on them).
    p = 24
    gen = generate(model, [rows[0][:p], rows[1][:p]], max_new_tokens=tokens.shape[1] - p,
                   features=TopicFeatures(lda, pieces))
    full = [rows[r][:p] + gen[r] for r in range(2)]
    full_topics = jnp.asarray(np.stack([token_topics(lda, f, pieces)[0] for f in full]))
    ranked = np.asarray(forward(model, jnp.asarray(full), full_topics)).argmax(-1)
    for r in range(2):
        np.testing.assert_array_equal(ranked[r, p - 1:-1], gen[r])


def batch_of(lda, cfg):
    pieces = piece_table(ByteTokenizer())
    data = list(b"ocean wave salt tide reef, flame ember smoke ash heat. tide salt!")[:33]
    top, lab = token_topics(lda, data, pieces)
    rows = lambda a: jnp.asarray(np.stack([a, a[::-1]]), jnp.int32)
    return {"inputs": rows(np.array(data[:-1])), "targets": rows(np.array(data[1:])),
            "topics": rows(top[:-1]), "topic_labels": rows(lab[:-1])}


def test_alpha_zero_gives_plain_next_token_gradients(lda):
    cfg = doe_config(alpha=0.0)
    model = make_model(cfg, seed=2)
    batch = batch_of(lda, cfg)
    assert np.any(np.asarray(batch["topic_labels"]) != K)

    def plain(m):
        noise = objective.noise_key(batch["inputs"])
        logits, _ = m(batch["inputs"], features={"topics": batch["topics"]}, noise=noise)
        return cross_entropy(logits, batch["targets"], jnp.ones_like(batch["targets"], bool))

    @nnx.jit
    def grads(m):
        g_doe = nnx.grad(lambda mm: lm_loss(mm, batch)[0])(m)
        return g_doe, nnx.grad(plain)(m)

    g_doe, g_plain = grads(model)
    for a, b in zip(jax.tree.leaves(g_doe), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # and alpha > 0 changes them (the router's gradient gains the expert term)
    total, metrics = nnx.jit(lambda m: lm_loss(m, batch))(model)
    assert float(metrics["expert_loss"]) > 0
    np.testing.assert_allclose(total, metrics["ce_loss"], rtol=1e-6)     # alpha = 0



@pytest.mark.parametrize("doe", [{}, {"signal": "q", "vae_sharing": "per_layer"}])
def test_accounting_counts_every_doe_parameter(doe):
    from dagmoe_jax.model.accounting import account

    cfg = doe_config(layers=4, **doe)
    model = nnx.eval_shape(lambda: make_model(cfg))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    acc = account(cfg)
    assert acc.total_params == count
    assert acc.total_active_params == count - (cfg.vocab_size - 1) * cfg.d_model  # one embedding row
    assert acc.flops["doe_ffn"] == 3 * 4 * 2 * 5 * cfg.d_model * cfg.resolved_ffn_hidden


def test_gate_profile_groups_gates_by_label(tmp_path, rng):
    from dagmoe_jax.analysis.collection import record
    from dagmoe_jax.families.doe.analysis import gate_profile, plot_gate_profile, specialisation

    cfg = doe_config(layers=2)
    model = make_model(cfg, seed=4)
    batch = {"inputs": rng.integers(0, 256, (2, 12)), "topics": rng.integers(0, K + 1, (2, 12)),
             "topic_labels": rng.integers(-1, K + 1, (2, 12))}
    profile = gate_profile(model, [batch], K)
    gates = np.asarray(record(model, batch["inputs"],
                              features={"topics": jnp.asarray(batch["topics"])})["gates"])
    assert gates.shape == (2, 2, 12, K) and (gates == 0).any() and (gates > 0).any()
    label = batch["topic_labels"]
    for g in range(K):
        sel = label == g
        if sel.any():
            np.testing.assert_allclose(profile[:, g], gates[:, sel].mean(1), rtol=1e-5, atol=1e-7)
        else:
            assert np.isnan(profile[:, g]).all()
    assert specialisation(profile).shape == (2,)
    assert plot_gate_profile(profile, tmp_path / "gates.png").stat().st_size > 0
