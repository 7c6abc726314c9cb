"""Residual readings: a block that generalises the MoE layer equals it at initialisation.

The DAG-MoE block's eq. 6 puts x / K into each node and eq. 12 sums the nodes, so the block's
output already holds x = RMSNorm(h); the CoE chain's output holds x^(0) = x in every residual
mode. The decoder adds its own residual h around every block. These tests pin the default
readings (``AggregationConfig.dag_residual='once'``, ``CoEConfig.stream='once'``), under which
x reaches the stream once, against the plain MoE model with the same weights, and check that
the residual stream keeps the size MoE gives it. The literal readings are kept as options and
shown to do what the finding said: add a whole RMSNorm(h) per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_model, tiny_config, tiny_execution
from dagmoe_jax.model.attention import rope_angles

NO_DROP = dict(capacity_factor=4.0)   # C = T * K: nothing is dropped, so routing is per token
B, S = 2, 12


def tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (B, S), 0, 64)


def variables(model):
    return {path: node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)}


def copy_shared_weights(src, dst) -> int:
    """Give ``dst`` every parameter of ``src`` it has under the same path; returns how many."""
    dst_vars = variables(dst)
    copied = 0
    for path, var in variables(src).items():
        if path in dst_vars:
            assert dst_vars[path].shape == var.shape, path
            dst_vars[path][...] = var[...]
            copied += 1
    return copied


def logits(model, toks):
    return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, toks))


def stream_norms(model, toks):
    """Mean ||h|| over tokens after the embedding and after each layer (at init)."""
    cfg = model.cfg
    sin, cos = rope_angles(jnp.arange(toks.shape[1])[None, :], cfg.resolved_head_dim,
                           cfg.rope_theta)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0),
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    def run(h, layer):              # the model's own layer loop, keeping ||h|| per layer
        h, _, _ = layer(h, sin, cos)
        return h, jnp.mean(jnp.linalg.norm(h, axis=-1))

    _, norms = nnx.jit(lambda m, t: run(m.embed[...][t], m.layers))(model, toks)
    return np.asarray(norms)


def test_dag_moe_with_zero_w_up_equals_moe_logits():
    moe_cfg = tiny_config("moe", "sum", experts=NO_DROP)
    moe = make_model(moe_cfg)
    dag = make_model(tiny_config("moe", "dag", experts=NO_DROP), seed=1)
    assert copy_shared_weights(moe, dag) == len(variables(moe))        # every MoE weight
    assert np.all(np.asarray(dag.layers.block.aggregator.iterations.w_up[...]) == 0)
    toks = tokens()
    want = logits(moe, toks)
    got = logits(dag, toks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    # The literal reading (x counted twice) is a different model from the first step on.
    literal = make_model(tiny_config("moe", "dag", experts=NO_DROP,
                                      aggregation=dict(dag_residual="literal")), seed=1)
    copy_shared_weights(moe, literal)
    assert np.abs(logits(literal, toks) - want).max() > 100 * np.abs(got - want).max() + 1e-3

    # With W_up non-zero the DAG really changes the output (the equality is not vacuous).
    w_up = dag.layers.block.aggregator.iterations.w_up
    w_up[...] = 0.5 * jax.random.normal(jax.random.key(2), w_up.shape)
    assert np.abs(logits(dag, toks) - want).max() > 1e-3


@pytest.mark.parametrize("residual", ["inner", "outer", "init"])
def test_coe_with_zero_experts_equals_the_standard_layer(residual):
    """Experts outputting zero: the CoE layer ('once') is the layer h + 0, as MoE's is."""
    moe = make_model(tiny_config("moe", "sum", experts=NO_DROP))
    coe = make_model(tiny_config("coe", experts=NO_DROP, coe=dict(residual=residual)), seed=1)
    literal = make_model(tiny_config("coe", experts=NO_DROP,
                                      coe=dict(residual=residual, stream="literal")), seed=1)
    for model in (moe, coe, literal):
        model.layers.block.experts.w_down[...] = jnp.zeros_like(model.layers.block.experts.w_down[...])
    copy_shared_weights(moe, coe)
    copy_shared_weights(moe, literal)
    toks = tokens(3)
    want = logits(moe, toks)
    got = logits(coe, toks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(logits(literal, toks) - want).max() > 1e-3


def test_coe_reference_reading_replaces_the_stream():
    """The CoE authors' decoder: h <- RMSNorm(h) + updates. With zero experts, each layer's
    output is the block norm of its input (after attention), a unit-RMS stream."""
    cfg = tiny_config("coe", experts=NO_DROP, coe=dict(stream="reference"))
    model = make_model(cfg)
    model.layers.block.experts.w_down[...] = jnp.zeros_like(model.layers.block.experts.w_down[...])
    norms = stream_norms(model, tokens(4))
    # RMSNorm with unit scale: ||h|| = sqrt(d) after every layer, up to its eps (1e-5 against
    # a mean square of ~4e-4 for the first layer's input, the embedding: about 1%).
    np.testing.assert_allclose(norms, np.sqrt(cfg.d_model), rtol=0.03)


BLOCKS = {
    "dense": tiny_config("dense"),
    "moe + shared": tiny_config("moe", "sum", experts=dict(num_shared=1, **NO_DROP)),
    "dag": tiny_config("moe", "dag", experts=NO_DROP),
    "dag + shared": tiny_config("moe", "dag", experts=dict(num_shared=1, **NO_DROP)),
    "mlp": tiny_config("moe", "mlp", experts=NO_DROP),
    "coe inner": tiny_config("coe", experts=NO_DROP),
    "coe outer": tiny_config("coe", experts=NO_DROP, coe=dict(residual="outer")),
    "coe init": tiny_config("coe", experts=NO_DROP, coe=dict(residual="init")),
}


def test_residual_stream_keeps_moe_size_at_init_for_every_block():
    """Finding 1 of the fidelity review: with x counted twice, each DAG layer added a whole
    RMSNorm(h) (norm sqrt(d)) to a stream whose other updates are ~0.1; this would catch it."""
    toks = tokens(5)
    moe = stream_norms(make_model(tiny_config("moe", "sum", experts=NO_DROP)), toks)
    for name, cfg in BLOCKS.items():
        norms = stream_norms(make_model(cfg), toks)
        ratio = norms / moe
        assert np.all((ratio > 1 / 3) & (ratio < 3)), (name, norms, moe)
    literal = tiny_config("moe", "dag", experts=NO_DROP, aggregation=dict(dag_residual="literal"))
    norms = stream_norms(make_model(literal), toks)
    assert np.all(norms / moe > 10), (norms, moe)


def np_coe(x, routers, experts, shared, k_t, score_fn):
    """CoE eq. 4-7 with inner residuals (eq. 5), 'once' stream, in float64: per iteration t,
    s_t = score(e_t^T x^(t-1)) over all N experts (eq. 7: Softmax; or sigmoid), g_t,i = s_t,i for
    the top K_t, x^(t) = sum_i g_t,i E_i(x^(t-1)) + shared(x^(t-1)) + x^(t-1); returns x^(C) - x."""
    silu = lambda v: v / (1.0 + np.exp(-v))
    swiglu = lambda v, g, u, dn: (silu(v @ g) * (v @ u)) @ dn
    h = np.asarray(x, np.float64)
    for w_router in routers:
        z = h @ w_router
        if score_fn == "softmax":
            s = np.exp(z - z.max(-1, keepdims=True))
            s = s / s.sum(-1, keepdims=True)
        else:
            s = 1.0 / (1.0 + np.exp(-z))
        update = swiglu(h, *shared)
        for t in range(h.shape[0]):
            for i in np.argsort(-s[t], kind="stable")[:k_t]:
                update[t] += s[t, i] * swiglu(h[t], *(w[i] for w in experts))
        h = h + update
    return h - x


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_coe_block_matches_numpy_with_its_softmax_router(score_fn):
    """CoEConfig.score_fn='softmax' is CoE eq. 7's router (softmax over the N experts, then
    top-K_t, not renormalised) in every iteration, whatever RouterConfig.score_fn says."""
    from dagmoe_jax.model.block import BlockInputs
    from dagmoe_jax.families.coe.block import CoEBlock

    cfg = tiny_config("coe", experts=dict(num_shared=1), router=dict(top_k=4, score_fn="sigmoid"),
                      coe=dict(score_fn=score_fn if score_fn == "softmax" else None))
    block = CoEBlock(cfg, tiny_execution(cfg, grouped_matmul="einsum"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(5)
    for _, var in variables(block).items():                  # O(1) random weights everywhere
        var[...] = jnp.asarray(rng.normal(scale=0.3, size=var.shape).astype(np.float32))
    x = rng.normal(size=(1, 6, cfg.d_model)).astype(np.float32)
    got = np.asarray(block(BlockInputs(jnp.asarray(x)))[0])[0]
    f64 = lambda v: np.asarray(v[...], np.float64)
    routers = [f64(r.w_router) for r in block.routers]
    experts = [f64(block.experts.w_gate), f64(block.experts.w_up), f64(block.experts.w_down)]
    shared = [f64(block.shared.w_gate), f64(block.shared.w_up), f64(block.shared.w_down)]
    want = np_coe(x[0], routers, experts, shared, cfg.block.resolved_top_k, score_fn)
    other = np_coe(x[0], routers, experts, shared, cfg.block.resolved_top_k,
                   "sigmoid" if score_fn == "softmax" else "softmax")
    assert np.abs(other - want).max() > 1e-2 * np.abs(want).max()     # the router matters
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
