"""DoE's alternative readings (docs/design.md section 6): the sparse knowledge-block experts with
Top-N and zero-gate skipping, eq. 2's scale, one knowledge state shared by every layer, and the
VAE's log sigma; each against NumPy, with the properties the paper claims for them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dagmoe_jax.families.doe.config import DoEConfig
from dagmoe_jax.families.doe import block as D
from dagmoe_jax.families.doe import knowledge_blocks as KB
from dagmoe_jax.model.accounting import account
from test_doe import K, doe_config, silu, softmax
from conftest import make_model, tiny_execution


def swiglu_np(x, wg, wu, wd):
    return silu(x @ wg) * (x @ wu) @ wd


def blocks_numpy(x, gates, weights, n):
    """sum over each token's Top-N gates of G_k FFN_k(x), every slice in NumPy."""
    wg, wu, wd = (np.asarray(w, np.float64) for w in weights)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in np.argsort(-gates[t], kind="stable")[:n]:
            out[t] += gates[t, k] * swiglu_np(x[t], wg[k], wu[k], wd[k])
    return out


def random_weights(rng, k=K, d=12, hb=5):
    return tuple(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
                 for s in ((k, d, hb), (k, d, hb), (k, hb, d)))


def _needs_compiler(name):
    from dagmoe_jax.kernels import build as kbuild
    return pytest.param(name, marks=pytest.mark.skipif(
        kbuild.compiler() is None, reason="the CPU grouped matmul needs a C++ compiler"))


@pytest.mark.parametrize("n", [1, 3, K])
@pytest.mark.parametrize("kind", ["relu", "softmax"])
@pytest.mark.parametrize("grouped", ["ragged_dot", _needs_compiler("cpu_gmm")])
def test_top_n_skipping_equals_the_masked_dense_computation(rng, n, kind, grouped):
    x = jnp.asarray(rng.normal(size=(20, 12)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(20, K)), jnp.float32)
    logits = logits.at[3].set(-1.0)                 # a token with every gate zero
    gates = D.gate_values(logits, kind)
    weights = random_weights(rng)
    got, ids = KB.sparse_blocks(x, gates, weights, n, grouped)
    dense = KB.masked_dense_blocks(x, gates, weights, n)
    np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, blocks_numpy(np.asarray(x, np.float64), np.asarray(gates),
                                                 weights, n), rtol=1e-4, atol=1e-6)
    ids, g = np.asarray(ids), np.asarray(gates)
    assert ids.shape == (20, n)
    # skipped exactly where the selected gate is zero; none run for the all-zero token
    np.testing.assert_array_equal(ids == K, -np.sort(-g, axis=-1)[:, :n] <= 0)
    if kind == "relu":
        assert (ids[3] == K).all()
    # gradients too: the grouped computation differentiates like the masked dense one
    f = lambda fn: lambda w, xx: jnp.sum(jnp.sin(fn(xx, gates, w, n, grouped)[0] if fn is
                                                 KB.sparse_blocks else fn(xx, gates, w, n)))
    gs = jax.grad(f(KB.sparse_blocks), argnums=(0, 1))(weights, x)
    gd = jax.grad(f(KB.masked_dense_blocks), argnums=(0, 1))(weights, x)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gd)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def blocks_block_numpy(block, shared, x, signal, topic_term, index, n, d_k=None):
    """The DoE block with expert='blocks' (z = mu) in NumPy: eq. 1-3, 5, ReLU gates, Top-N."""
    p = lambda a: np.asarray(a[...], np.float64)
    zk = p(block.knowledge)
    h_enr = x + softmax((x @ p(block.w_q)) @ zk.T / np.sqrt(d_k or zk.shape[1])) @ zk
    v = {m: p(getattr(shared, f"vae_{m}"))[index] for m in D.VAE_NAMES}
    pre = h_enr @ v["w_h"] + signal @ v["w_s"] + v["b_e"] + (topic_term if index == 0 else 0)
    e = silu(pre)
    mu, logvar = e @ v["w_mu"] + v["b_mu"], np.clip(e @ v["w_lv"] + v["b_lv"], -10, 10)
    gates = np.maximum(mu @ p(block.w_g) + p(block.b_g), 0)
    b, s, d = x.shape
    w = (p(block.block_gate), p(block.block_up), p(block.block_down))
    out = blocks_numpy(h_enr.reshape(b * s, d), gates.reshape(b * s, -1), w, n)
    return out.reshape(b, s, d), gates, 0.5 * logvar.mean()


def make_block(rng, **doe):
    cfg = doe_config(**doe)
    rngs = nnx.Rngs(0)
    block = D.DoEBlock(cfg, tiny_execution(cfg), rngs=rngs)
    shared = D.DoEShared(cfg, rngs=rngs)
    x = rng.normal(size=(2, 6, cfg.d_model)).astype(np.float32)
    signal = rng.normal(size=(2, 6, D.signal_dim(cfg))).astype(np.float32)
    topic = rng.normal(size=(2, 6, 16)).astype(np.float32)
    inputs = D.DoESharedInputs(shared.bank(), jnp.asarray(topic))
    return cfg, block, shared, x, signal, topic, inputs


@pytest.mark.parametrize("top_n", [0, 3])
def test_blocks_reading_matches_numpy(rng, top_n):
    cfg, block, shared, x, signal, topic, inputs = make_block(rng, expert="blocks", top_n=top_n)
    assert block.block_gate.shape == (K, cfg.d_model, cfg.resolved_ffn_hidden // K)
    assert not hasattr(block, "w_gate")
    layer = D.DoELayerInputs(jnp.int32(0), jnp.asarray(False))
    out, stats = block.apply(jnp.asarray(x), jnp.asarray(signal), layer, inputs)
    n = top_n or K
    want, gates, log_sigma = blocks_block_numpy(block, shared, x.astype(np.float64), signal,
                                                topic, 0, n)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=1e-6)
    ran = np.minimum((gates > 0).sum(-1), n) / K
    np.testing.assert_allclose(stats.extra.active_fraction, ran.mean(), rtol=1e-6)
    np.testing.assert_allclose(stats.extra.log_sigma, log_sigma, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("expert", ["blocks", "composed"])
def test_a_zero_gate_gives_its_block_zero_gradient(rng, expert):
    """Appendix I.3's gradient isolation: a knowledge block whose gate is zero on every token
    gets exactly zero gradient in its FFN slice (sparse reading); under the composed reading
    the one dense FFN is updated whatever the gates."""
    cfg, block, shared, x, signal, topic, inputs = make_block(rng, expert=expert)
    block.b_g[...] = block.b_g[...].at[2].set(-1e4)                 # gate 2 is 0 everywhere
    layer = D.DoELayerInputs(jnp.int32(1), jnp.asarray(False), jax.random.key(0))
    target = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def loss(model):
        out, stats = model.apply(jnp.asarray(x), jnp.asarray(signal), layer, inputs)
        return jnp.sum((out - target) ** 2), stats

    grads, stats = nnx.grad(loss, has_aux=True)(block)
    assert float(stats.extra.gate_mean[2]) == 0.0
    if expert == "composed":
        assert float(jnp.abs(grads.w_down[...]).sum()) > 0
        return
    for name in ("block_gate", "block_up", "block_down"):
        g = np.asarray(getattr(grads, name)[...])
        assert np.all(g[2] == 0.0), name
        assert np.all(np.abs(g[[0, 1, 3]]).sum(axis=(1, 2)) > 0), name


def test_blocks_accounting_counts_active_slices():
    cfg = doe_config(layers=4, expert="blocks", top_n=2, block_hidden=6, shared_knowledge=True)
    model = nnx.eval_shape(lambda: make_model(cfg))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    acc = account(cfg)
    assert acc.total_params == count
    assert acc.params["doe_ffn"] == 4 * K * 3 * cfg.d_model * 6
    assert acc.active_params["doe_ffn"] == 4 * 2 * 3 * cfg.d_model * 6
    inactive = (K - 2) * 3 * cfg.d_model * 6 * 4 + (cfg.vocab_size - 1) * cfg.d_model
    assert acc.total_active_params == count - inactive
    assert acc.flops["doe_ffn"] == 3 * 4 * 2 * 2 * 3 * cfg.d_model * 6


@pytest.mark.parametrize("scale", ["d_model", "topic_dim", "head_dim"])
def test_knowledge_scale_matches_numpy(rng, scale):
    cfg, block, shared, x, signal, topic, inputs = make_block(rng, knowledge_scale=scale)
    d_k = {"d_model": cfg.d_model, "topic_dim": cfg.block.topic_dim,
           "head_dim": cfg.resolved_head_dim}[scale]
    assert D.knowledge_scale_dim(cfg) == d_k
    q = rng.normal(size=(2, 5, 16)).astype(np.float32)
    z = rng.normal(size=(K, 16)).astype(np.float32)
    np.testing.assert_allclose(D.knowledge_attention(jnp.asarray(q), jnp.asarray(z), d_k),
                               softmax(q @ z.T / np.sqrt(d_k)) @ z, rtol=1e-5, atol=1e-6)


def test_shared_knowledge_is_one_z_read_by_every_layer(rng):
    cfg = doe_config(layers=3, shared_knowledge=True, expert="blocks",
                     knowledge_scale="topic_dim")
    model = nnx.eval_shape(lambda: make_model(cfg))
    paths = [p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))
             if p[-1] == "knowledge"]
    assert paths == [("doe", "knowledge")]
    rngs = nnx.Rngs(0)
    block = D.DoEBlock(cfg, tiny_execution(cfg), rngs=rngs)
    shared = D.DoEShared(cfg, rngs=rngs)
    x = rng.normal(size=(2, 6, cfg.d_model)).astype(np.float32)
    signal = rng.normal(size=(2, 6, D.signal_dim(cfg))).astype(np.float32)
    z = jnp.asarray(rng.normal(size=(K, cfg.d_model)), jnp.float32)
    inputs = D.DoESharedInputs(shared.bank(), None, None, z)
    out, _ = block.apply(jnp.asarray(x), jnp.asarray(signal),
                         D.DoELayerInputs(jnp.int32(1), jnp.asarray(False)), inputs)
    block.knowledge = nnx.Param(z)                   # the NumPy block reads Z from the block
    want, _, _ = blocks_block_numpy(block, shared, x.astype(np.float64), signal, 0.0, 1, K,
                                    d_k=cfg.block.topic_dim)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=1e-6)


def test_reading_config_errors():
    with pytest.raises(ValueError, match="DoEConfig.expert"):
        DoEConfig(expert="ffn")
    with pytest.raises(ValueError, match="DoEConfig.top_n"):
        DoEConfig(top_n=2)
    with pytest.raises(ValueError, match="DoEConfig.top_n"):
        DoEConfig(expert="blocks", num_topics=4, top_n=5)
    with pytest.raises(ValueError, match="DoEConfig.block_hidden"):
        DoEConfig(block_hidden=8)
    with pytest.raises(ValueError, match="DoEConfig.knowledge_scale"):
        DoEConfig(knowledge_scale="sqrt")
    with pytest.raises(ValueError, match="DoEConfig.shared_knowledge"):
        DoEConfig(shared_knowledge=1)


def agreement(logits, labels):
    """Share of labelled tokens whose router argmax (every layer) is their LDA label."""
    valid = (labels >= 0) & (labels < K)
    hit = np.asarray(logits).argmax(-1) == labels[None]
    return float(hit[:, valid].mean())


@pytest.mark.parametrize("doe", [{}, {"expert": "blocks", "top_n": 2, "shared_knowledge": True}])
def test_alpha_teaches_the_routers_the_lda_labels(doe):
    """Eq. 4's L_expert: with alpha > 0 the routers' agreement with the labels rises over
    training, and ends above the same run's with alpha = 0 (synthetic labels: token id mod K)."""
    import optax

    from dagmoe_jax.train.step import lm_loss

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (4, 33))
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
             "topics": jnp.full((4, 32), K, jnp.int32),
             "topic_labels": jnp.asarray(tokens[:, :-1] % K, jnp.int32)}
    labels = np.asarray(batch["topic_labels"])
    results = {}
    for alpha in (0.0, 0.5):
        model = make_model(doe_config(layers=2, alpha=alpha, **doe), seed=1)
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.adam(1e-2)
        opt = tx.init(params)

        def router(p):
            _, aux = nnx.merge(graph, p, rest)(batch["inputs"],
                                               features={"topics": batch["topics"]})
            return aux["extra"].router_logits

        @jax.jit
        def step(p, o):
            g = jax.grad(lambda q: lm_loss(nnx.merge(graph, q, rest), batch)[0])(p)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o

        before = agreement(jax.jit(router)(params), labels)
        for _ in range(30):
            params, opt = step(params, opt)
        results[alpha] = (before, agreement(jax.jit(router)(params), labels))
    (b0, a0), (b1, a1) = results[0.0], results[0.5]
    assert a1 > b1 + 0.3, results
    assert a1 > a0 + 0.3, results
