"""The DAG learning module (DAG-MoE eq. 6-12), its readings (shared weights, the edge-free
ablation) and the MLP mixer, against independent oracles.

The oracles are written here from the paper, not from the library: a NumPy loop over tokens and
node pairs that builds the concatenation [u_i; u_j] of eq. 9 explicitly (with the paper's weight
layout, W [out, in] applied as W @ v), and a JAX version that materialises the full
[T, K, K, 2 d_g] pair tensor the library avoids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.families.moe.budget import dag_params_per_layer
from dagmoe_jax.kernels.dag_module import fused_dag_messages, fused_layer_norm
from dagmoe_jax.families.moe.aggregation import MLPMixer, mlp_mix, weighted_sum
from dagmoe_jax.families.moe.dag import (DAG_EXECUTIONS, DAGAggregator, dag_execution,
                                         dag_initial_nodes, dag_iteration, dag_node_update,
                                         dag_readout, dag_summed_update)

D, DG, K, T = 32, 16, 3, 5
EPS = 1e-5


# ----------------------------------------------------------------------------- oracles

def np_silu(v):
    return v / (1.0 + np.exp(-v))


def np_sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


NP_ACT = {"silu": np_silu, "sigmoid": np_sigmoid}


def np_layer_norm(v, scale, bias, eps):
    mean = v.mean()
    var = ((v - mean) ** 2).mean()
    return (v - mean) / np.sqrt(var + eps) * scale + bias


def np_dag_moe(x, gates, expert_out, paper_params, edge_act, eps=EPS, edges="all",
               reading="once"):
    """DAG-MoE eq. 6-12 transcribed literally, in float64.

    ``paper_params`` is a list over iterations l of dicts with the paper's shapes:
    W_down [d_g, d], W_edge [d_g, 2 d_g], W_node [d_g, 2 d_g], W_up [d, d_g], ln_scale/ln_bias [d].
    ``reading='literal'`` returns eq. 12's y; 'once' (the block's default,
    ``AggregationConfig.dag_residual``) returns y - x, the residual x counted once by the
    decoder's own h + block output.
    """
    x = np.asarray(x, np.float64)
    gates = np.asarray(gates, np.float64)
    expert_out = np.asarray(expert_out, np.float64)
    t_count, k_count, _ = expert_out.shape
    act = NP_ACT[edge_act]
    y = np.zeros_like(x)
    for t in range(t_count):
        # eq. 6: x_i^0 = g_i E_i(x) + x / K
        nodes = [gates[t, i] * expert_out[t, i] + x[t] / k_count for i in range(k_count)]
        for p in paper_params:
            w_down, w_edge, w_node, w_up = (np.asarray(p[n], np.float64)
                                            for n in ("W_down", "W_edge", "W_node", "W_up"))
            scale, bias = np.asarray(p["ln_scale"], np.float64), np.asarray(p["ln_bias"], np.float64)
            # eq. 7-8
            down = [w_down @ np_layer_norm(n, scale, bias, eps) for n in nodes]
            new_nodes = []
            for i in range(k_count):
                acc = np.zeros(w_up.shape[1])
                senders = {"all": range(k_count), "ranked": range(i + 1), "self": [i]}[edges]
                for j in senders:
                    pair = np.concatenate([down[i], down[j]])           # eq. 9
                    edge = act(w_edge @ pair)                           # eq. 10
                    acc += edge * (w_node @ pair)                       # eq. 10, summed as eq. 11
                new_nodes.append(w_up @ acc + nodes[i])                 # eq. 11
            nodes = new_nodes
        y[t] = np.sum(nodes, axis=0)                                    # eq. 12
    return y - x if reading == "once" else y


def naive_jax_dag(x, gates, expert_out, lib_params, edge_act, eps=EPS):
    """The same equations in JAX, materialising the [T, K, K, 2 d_g] pair tensor of eq. 9;
    the 'once' reading (y - x).

    ``lib_params`` uses the library's layout (v @ W): stacked over iterations.
    """
    act = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}[edge_act]
    k = gates.shape[1]
    nodes = gates[..., None] * expert_out + x[:, None, :] / k
    for l in range(lib_params["w_up"].shape[0]):
        mean = nodes.mean(-1, keepdims=True)
        var = ((nodes - mean) ** 2).mean(-1, keepdims=True)
        normed = (nodes - mean) / jnp.sqrt(var + eps) * lib_params["ln_scale"][l] \
            + lib_params["ln_bias"][l]
        u = normed @ lib_params["w_down"][l]                                   # [T, K, dg]
        ui = jnp.broadcast_to(u[:, :, None, :], u.shape[:2] + (k, u.shape[-1]))
        uj = jnp.broadcast_to(u[:, None, :, :], ui.shape)
        pair = jnp.concatenate([ui, uj], axis=-1)                              # [T, K, K, 2dg]
        msg = act(pair @ lib_params["w_edge"][l]) * (pair @ lib_params["w_node"][l])
        nodes = msg.sum(axis=2) @ lib_params["w_up"][l] + nodes
    return nodes.sum(axis=1) - x


# ----------------------------------------------------------------------------- helpers

def random_inputs(rng, t=T, k=K, d=D):
    x = rng.normal(size=(t, d)).astype(np.float32)
    gates = rng.uniform(0.1, 1.0, size=(t, k)).astype(np.float32)
    expert_out = rng.normal(size=(t, k, d)).astype(np.float32)
    return x, gates, expert_out


def random_lib_params(rng, iters, d=D, dg=DG):
    """Random weights in the library's layout, scaled so every term of eq. 11 is O(1)."""
    f32 = lambda a: np.asarray(a, np.float32)
    return {
        "ln_scale": f32(rng.uniform(0.5, 1.5, size=(iters, d))),
        "ln_bias": f32(rng.normal(scale=0.3, size=(iters, d))),
        "w_down": f32(rng.normal(scale=1 / np.sqrt(d), size=(iters, d, dg))),
        "w_edge": f32(rng.normal(scale=1 / np.sqrt(2 * dg), size=(iters, 2 * dg, dg))),
        "w_node": f32(rng.normal(scale=1 / np.sqrt(2 * dg), size=(iters, 2 * dg, dg))),
        "w_up": f32(rng.normal(scale=1 / np.sqrt(dg), size=(iters, dg, d))),   # non-zero
    }


def to_paper_layout(lib_params):
    """Library weights act as v @ W; the paper's act as W @ v, so W_paper = W_lib^T."""
    return [{"W_down": lib_params["w_down"][l].T, "W_edge": lib_params["w_edge"][l].T,
             "W_node": lib_params["w_node"][l].T, "W_up": lib_params["w_up"][l].T,
             "ln_scale": lib_params["ln_scale"][l], "ln_bias": lib_params["ln_bias"][l]}
            for l in range(lib_params["w_up"].shape[0])]


def make_dag(iters, edge_act, lib_params=None, edges="all", reading="once", shared=False,
             mode="xla"):
    """The DAG module with ``lib_params``, run as ``ExecutionConfig.dag_module=mode``: 'fused'
    (the C++ kernels), 'xla' (XLA's pair tensor, projections on [T*K, .] rows) or 'xla_rank3'
    (the same on the [T, K, .] node arrays, TPU's)."""
    cfg = tiny_config("moe", "dag", d_model=D, norm_eps=EPS,
                      aggregation=dict(dag_dim=DG, dag_iters=iters, edge_act=edge_act,
                                       dag_edges=edges, dag_residual=reading,
                                       dag_shared_weights=shared))
    execution = ExecutionConfig(dag_module=mode)
    module = DAGAggregator(cfg.block.aggregation, D, std=cfg.init_std, eps=EPS,
                           execution=execution, rngs=nnx.Rngs(0))
    if lib_params is not None:
        for name, value in lib_params.items():
            var = getattr(module.iterations, name)
            assert var.shape == value.shape, (name, var.shape, value.shape)
            var[...] = jnp.asarray(value)
    return module


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# ----------------------------------------------------------------------------- tests

MODES = ["xla", "xla_rank3", "fused", "bottleneck"]      # ExecutionConfig.dag_module: every test runs each

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("edge_act", ["silu", "sigmoid"])
@pytest.mark.parametrize("iters,reading", [(1, "once"), (2, "literal"), (3, "once")])
def test_dag_module_matches_numpy_paper_transcription(edge_act, iters, reading, mode):
    rng = np.random.default_rng(10 * iters + (edge_act == "sigmoid"))
    x, gates, expert_out = random_inputs(rng)
    params = random_lib_params(rng, iters)
    expected = np_dag_moe(x, gates, expert_out, to_paper_layout(params), edge_act,
                          reading=reading)

    module = make_dag(iters, edge_act, params, reading=reading, mode=mode)
    got = module(jnp.asarray(x), jnp.asarray(gates), jnp.asarray(expert_out))[0]
    assert got.shape == (T, D) and got.dtype == jnp.float32
    # The DAG really contributes something beyond the weighted sum (+ residual) here, so the
    # comparison exercises eq. 7-11 and not only eq. 6 and 12.
    trivial = np.asarray(weighted_sum(jnp.asarray(gates), jnp.asarray(expert_out)))
    trivial = trivial + x if reading == "literal" else trivial
    assert rel_err(trivial, expected) > 0.1
    assert rel_err(got, expected) < 1e-5


@pytest.mark.parametrize("edge_act", ["silu", "sigmoid"])
@pytest.mark.parametrize("iters", [1, 2, 3])
def test_dag_iteration_function_matches_numpy_paper_transcription(edge_act, iters):
    rng = np.random.default_rng(100 + 10 * iters + (edge_act == "sigmoid"))
    x, gates, expert_out = random_inputs(rng)
    params = random_lib_params(rng, iters)
    expected = np_dag_moe(x, gates, expert_out, to_paper_layout(params), edge_act,
                          reading="literal")

    updates, residual = dag_initial_nodes(jnp.asarray(x), jnp.asarray(gates),
                                          jnp.asarray(expert_out))
    nodes = updates + residual                                       # eq. 6's two terms
    for l in range(iters):
        nodes = dag_iteration(nodes, *(jnp.asarray(params[n][l]) for n in
                                       ("ln_scale", "ln_bias", "w_down", "w_edge", "w_node",
                                        "w_up")),
                              edge_act=edge_act, eps=EPS)
        assert nodes.shape == (T, K, D)
    assert rel_err(dag_readout(nodes), expected) < 1e-5


@pytest.mark.parametrize("edge_act", ["silu", "sigmoid"])
def test_dag_module_matches_naive_pair_tensor_jax(edge_act):
    rng = np.random.default_rng(7)
    x, gates, expert_out = random_inputs(rng, t=9, k=4)
    params = random_lib_params(rng, 2)
    naive = jax.jit(naive_jax_dag, static_argnums=(4,))(
        jnp.asarray(x), jnp.asarray(gates), jnp.asarray(expert_out),
        jax.tree.map(jnp.asarray, params), edge_act)
    module = make_dag(2, edge_act, params)
    got = module(jnp.asarray(x), jnp.asarray(gates), jnp.asarray(expert_out))[0]
    assert rel_err(got, naive) < 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("iters", [1, 2])
def test_zero_init_is_weighted_sum_under_each_reading(iters, mode):
    """W_up = 0 (its initialisation): the 'once' block is exactly the weighted sum of eq. 1,
    so a DAG-MoE layer starts as the MoE layer; 'literal' adds x on top (eq. 6 + eq. 12)."""
    rng = np.random.default_rng(3)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, k=4))
    s = np.asarray(weighted_sum(gates, expert_out))
    once = make_dag(iters, "silu", mode=mode)              # fresh: w_up zero-initialised
    assert np.all(np.asarray(once.iterations.w_up[...]) == 0)
    got = np.asarray(once(x, gates, expert_out)[0])
    # With W_up = 0 every iteration adds an exact 0.0 to the carried updates g_k E_k, so the
    # output is sum_k g_k E_k summed by jnp.sum instead of einsum: a few ulps at most.
    np.testing.assert_allclose(got, s, rtol=0, atol=1e-6 * np.abs(s).max())
    literal = np.asarray(make_dag(iters, "silu", reading="literal", mode=mode)(
        x, gates, expert_out)[0])
    expected = s + np.asarray(x)
    np.testing.assert_allclose(literal, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    updates, residual = dag_initial_nodes(x, gates, expert_out)
    np.testing.assert_allclose(literal, np.asarray(dag_readout(updates + residual)), rtol=0,
                               atol=1e-6 * np.abs(expected).max())


def test_dag_is_permutation_invariant_but_not_a_function_of_the_sum():
    """What node order does and does not change (our finding; see the report).

    Eq. 11 updates node i from x_i and the *set* {u_j} (the sum over j is symmetric), and eq. 12
    sums the nodes, so eq. 6-12 as written are invariant to the order of the K nodes: swapping
    two selected experts (gate and output together) permutes the nodes and leaves y unchanged,
    exactly as for the weighted sum. What the DAG adds over eq. 1 is pairwise interaction: two
    node sets with the same weighted sum give different outputs.
    """
    rng = np.random.default_rng(11)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, k=4))
    params = random_lib_params(rng, 2)
    module = make_dag(2, "silu", params)
    perm = np.array([1, 0, 2, 3])
    y = np.asarray(module(x, gates, expert_out)[0])
    y_perm = np.asarray(module(x, gates[:, perm], expert_out[:, perm])[0])
    s = np.asarray(weighted_sum(gates, expert_out))
    s_perm = np.asarray(weighted_sum(gates[:, perm], expert_out[:, perm]))
    np.testing.assert_allclose(s_perm, s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y_perm, y, rtol=1e-5, atol=1e-5 * np.abs(y).max())

    # Node-level equivariance: one iteration permutes the nodes with the experts.
    lp = {n: jnp.asarray(v[0]) for n, v in params.items()}
    args = (lp["ln_scale"], lp["ln_bias"], lp["w_down"], lp["w_edge"], lp["w_node"], lp["w_up"])
    n0 = sum(dag_initial_nodes(x, gates, expert_out))
    n1 = np.asarray(dag_iteration(n0, *args, edge_act="silu", eps=EPS))
    n1_perm = np.asarray(dag_iteration(n0[:, perm], *args, edge_act="silu", eps=EPS))
    np.testing.assert_allclose(n1_perm, n1[:, perm], rtol=1e-5, atol=1e-5 * np.abs(n1).max())

    # Same weighted sum, different nodes: move mass between two experts' outputs.
    delta = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
    shifted = expert_out.at[:, 0].add(delta / gates[:, 0:1]).at[:, 1].add(-delta / gates[:, 1:2])
    np.testing.assert_allclose(np.asarray(weighted_sum(gates, shifted)), s, rtol=1e-5, atol=1e-5)
    y_shift = np.asarray(module(x, gates, shifted)[0])
    assert rel_err(y_shift, y) > 1e-2


def test_dag_parameter_shapes():
    for iters in (1, 3):
        module = make_dag(iters, "silu")
        it = module.iterations
        assert it.w_down.shape == (iters, D, DG)
        assert it.w_edge.shape == (iters, 2 * DG, DG)
        assert it.w_node.shape == (iters, 2 * DG, DG)
        assert it.w_up.shape == (iters, DG, D)
        assert it.ln_scale.shape == (iters, D)
        assert it.ln_bias.shape == (iters, D)
        np.testing.assert_array_equal(np.asarray(it.ln_scale[...]), 1.0)
        np.testing.assert_array_equal(np.asarray(it.ln_bias[...]), 0.0)
        # Each iteration has its own random weights (split rngs), not one copy stacked L times.
        if iters > 1:
            w = np.asarray(it.w_down[...])
            assert not np.allclose(w[0], w[1])
        n_params = sum(v.size for v in jax.tree.leaves(nnx.state(module, nnx.Param)))
        assert n_params == iters * (2 * D * DG + 4 * DG * DG + 2 * D)


def np_mlp_mix(s, w1, w2, w3, eps=EPS):
    """y = s + W3(silu(W1 LN(s)) * W2 LN(s)), LN without affine parameters, in float64."""
    s = np.asarray(s, np.float64)
    out = np.empty_like(s)
    for t in range(s.shape[0]):
        h = np_layer_norm(s[t], 1.0, 0.0, eps)
        out[t] = s[t] + (np_silu(h @ w1) * (h @ w2)) @ w3
    return out


def test_mlp_mixer_zero_init_is_weighted_sum():
    rng = np.random.default_rng(5)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng))
    cfg = tiny_config("moe", "mlp", d_model=D, norm_eps=EPS, aggregation=dict(dag_dim=DG))
    mixer = MLPMixer(cfg.block.aggregation, D, std=cfg.init_std, eps=EPS, rngs=nnx.Rngs(0))
    assert mixer.w_1.shape == (D, DG) and mixer.w_2.shape == (D, DG) and mixer.w_3.shape == (DG, D)
    assert np.all(np.asarray(mixer.w_3[...]) == 0)
    # W3 = 0 adds an exact 0.0 to s: bit-for-bit the weighted sum.
    np.testing.assert_array_equal(np.asarray(mixer(x, gates, expert_out)[0]),
                                  np.asarray(weighted_sum(gates, expert_out)))


def test_mlp_mixer_matches_numpy():
    rng = np.random.default_rng(6)
    x, gates, expert_out = random_inputs(rng)
    w1 = rng.normal(scale=1 / np.sqrt(D), size=(D, DG)).astype(np.float32)
    w2 = rng.normal(scale=1 / np.sqrt(D), size=(D, DG)).astype(np.float32)
    w3 = rng.normal(scale=1 / np.sqrt(DG), size=(DG, D)).astype(np.float32)
    cfg = tiny_config("moe", "mlp", d_model=D, norm_eps=EPS, aggregation=dict(dag_dim=DG))
    mixer = MLPMixer(cfg.block.aggregation, D, std=cfg.init_std, eps=EPS, rngs=nnx.Rngs(0))
    mixer.w_1[...], mixer.w_2[...], mixer.w_3[...] = (jnp.asarray(w) for w in (w1, w2, w3))
    s = np.einsum("tk,tkd->td", gates.astype(np.float64), expert_out.astype(np.float64))
    expected = np_mlp_mix(s, w1, w2, w3)
    got = mixer(jnp.asarray(x), jnp.asarray(gates), jnp.asarray(expert_out))[0]
    assert rel_err(s, expected) > 0.1                       # the mixer term is not negligible
    assert rel_err(got, expected) < 1e-5
    assert rel_err(mlp_mix(jnp.asarray(s, jnp.float32), *(jnp.asarray(w) for w in (w1, w2, w3)),
                           EPS), expected) < 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("iters", [1, 2])
def test_ranked_edges_match_numpy_and_make_the_output_order_sensitive(iters, mode):
    """dag_edges='ranked' (our extension): node i aggregates only from nodes j <= i in the
    router's rank order, so unlike eq. 9-11 as written the output depends on the node order:
    swapping two selected experts changes the DAG output but not the weighted sum."""
    rng = np.random.default_rng(21)
    x, gates, expert_out = random_inputs(rng, k=4)
    params = random_lib_params(rng, iters)
    module = make_dag(iters, "silu", params, edges="ranked", mode=mode)
    got = module(jnp.asarray(x), jnp.asarray(gates), jnp.asarray(expert_out))[0]
    want = np_dag_moe(x, gates, expert_out, to_paper_layout(params), "silu", edges="ranked")
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, np_dag_moe(x, gates, expert_out, to_paper_layout(params), "silu")) > 1e-2

    perm = np.array([1, 0, 2, 3])
    y_perm = module(jnp.asarray(x), jnp.asarray(gates[:, perm]), jnp.asarray(expert_out[:, perm]))[0]
    np.testing.assert_allclose(np.asarray(weighted_sum(jnp.asarray(gates[:, perm]),
                                                       jnp.asarray(expert_out[:, perm]))),
                               np.asarray(weighted_sum(jnp.asarray(gates), jnp.asarray(expert_out))),
                               rtol=1e-5, atol=1e-5)
    assert rel_err(y_perm, got) > 1e-3


# ----------------------------------------------------------------------------- readings

def loss_grads(module, x, gates, expert_out):
    """Gradients of a scalar of the module's output with respect to its parameters."""
    graphdef, params = nnx.split(module, nnx.Param)

    def loss(p):
        y = nnx.merge(graphdef, p)(x, gates, expert_out)[0]
        return jnp.sum(jnp.sin(y))

    return jax.grad(loss)(params)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("iters", [1, 2, 3])
def test_shared_weights_match_numpy_with_tied_weights(iters, mode):
    """dag_shared_weights=True: one module applied in every iteration ("each iteration applies
    the same module", DAG-MoE sec. 3.3), eq. 6-12 with W^l = W for all l."""
    rng = np.random.default_rng(40 + iters)
    x, gates, expert_out = random_inputs(rng, k=4)
    one = {n: v[0] for n, v in random_lib_params(rng, 1).items()}         # unstacked
    module = make_dag(iters, "silu", one, shared=True, mode=mode)
    assert module.iterations.w_down.shape == (D, DG)
    n_params = sum(v.size for v in jax.tree.leaves(nnx.state(module, nnx.Param)))
    assert n_params == dag_params_per_layer(D, DG, iters, shared=True) == 2 * D * DG \
        + 4 * DG * DG + 2 * D
    got = module(jnp.asarray(x), jnp.asarray(gates), jnp.asarray(expert_out))[0]
    paper = to_paper_layout({n: v[None] for n, v in one.items()})
    want = np_dag_moe(x, gates, expert_out, paper * iters, "silu")
    assert rel_err(got, want) < 1e-5
    if iters > 1:     # tying differs from L independent iterations
        assert rel_err(want, np_dag_moe(x, gates, expert_out, paper, "silu")) > 1e-2


def test_shared_weights_equal_per_iteration_weights_that_are_identical():
    rng = np.random.default_rng(44)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, k=4))
    one = {n: v[0] for n, v in random_lib_params(rng, 1).items()}
    shared = make_dag(3, "silu", one, shared=True)
    stacked = make_dag(3, "silu", {n: np.stack([v] * 3) for n, v in one.items()})
    shared.record_intermediates = stacked.record_intermediates = True
    (y_s, rec_s), (y_p, rec_p) = shared(x, gates, expert_out), stacked(x, gates, expert_out)
    np.testing.assert_allclose(np.asarray(y_s), np.asarray(y_p), rtol=1e-6, atol=1e-6)
    assert rec_s["edge_gates"].shape == rec_p["edge_gates"].shape == (3, T, 4, 4, DG)
    np.testing.assert_allclose(np.asarray(rec_s["edge_gates"]), np.asarray(rec_p["edge_gates"]),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("iters", [1, 2])
def test_edge_free_ablation_matches_numpy(iters, mode):
    """dag_edges='self' (ours): eq. 7-11 on the self pair (i, i) only, no message passing."""
    rng = np.random.default_rng(50 + iters)
    x, gates, expert_out = random_inputs(rng, k=4)
    params = random_lib_params(rng, iters)
    module = make_dag(iters, "silu", params, edges="self", mode=mode)
    got = module(jnp.asarray(x), jnp.asarray(gates), jnp.asarray(expert_out))[0]
    want = np_dag_moe(x, gates, expert_out, to_paper_layout(params), "silu", edges="self")
    trivial = np.asarray(weighted_sum(jnp.asarray(gates), jnp.asarray(expert_out)))
    assert rel_err(trivial, want) > 0.1                     # the per-node update is not negligible
    assert rel_err(got, want) < 1e-5
    assert rel_err(want, np_dag_moe(x, gates, expert_out, to_paper_layout(params), "silu")) > 1e-2
    # the same parameters as the DAG module it ablates
    n_params = sum(v.size for v in jax.tree.leaves(nnx.state(module, nnx.Param)))
    assert n_params == dag_params_per_layer(D, DG, iters)


def test_edge_free_node_updates_hear_only_themselves():
    rng = np.random.default_rng(53)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, k=4))
    lp = {n: jnp.asarray(v[0]) for n, v in random_lib_params(rng, 1).items()}
    args = (lp["ln_scale"], lp["ln_bias"], lp["w_down"], lp["w_edge"], lp["w_node"], lp["w_up"])
    n0 = sum(dag_initial_nodes(x, gates, expert_out))
    moved = n0.at[:, 2].add(jnp.asarray(rng.normal(size=(T, D)).astype(np.float32)))
    for edges, others_change in (("self", False), ("all", True)):
        a = np.asarray(dag_iteration(n0, *args, edge_act="silu", eps=EPS, edges=edges))
        b = np.asarray(dag_iteration(moved, *args, edge_act="silu", eps=EPS, edges=edges))
        others = [0, 1, 3]
        assert np.allclose(a[:, others], b[:, others], atol=1e-5) != others_change, edges
        assert not np.allclose(a[:, 2], b[:, 2], atol=1e-3)


@pytest.mark.parametrize("edges,shared", [("self", False), ("all", True), ("self", True)])
def test_readings_start_as_the_weighted_sum_and_train(edges, shared):
    """Zero-initialised W_up: each reading is exactly eq. 1 at init (as the default DAG), and
    the gradient reaches W_up (and, through it, nothing else yet)."""
    rng = np.random.default_rng(60)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, k=4))
    s = np.asarray(weighted_sum(gates, expert_out))
    module = make_dag(2, "silu", edges=edges, shared=shared)
    got = np.asarray(module(x, gates, expert_out)[0])
    np.testing.assert_allclose(got, s, rtol=0, atol=1e-6 * np.abs(s).max())
    grads = loss_grads(module, x, gates, expert_out)
    assert float(jnp.abs(grads["iterations"]["w_up"][...]).max()) > 1e-3
    assert float(jnp.abs(grads["iterations"]["w_down"][...]).max()) == 0.0


# ----------------------------------------------------------------------------- how it runs

@pytest.mark.parametrize("edges", ["all", "ranked", "self"])
@pytest.mark.parametrize("edge_act", ["silu", "sigmoid"])
def test_fused_messages_equal_xla_values_and_gradients(edges, edge_act):
    """ExecutionConfig.dag_module='fused' (the C++ kernels: the LayerNorm, and the messages that
    never build the pair tensor and recompute the gates in their backward pass) is the same
    function as XLA's:
    outputs and the gradients of every parameter and input agree to float32 rounding."""
    rng = np.random.default_rng(70)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, t=37, k=4))
    params = random_lib_params(rng, 2)
    xla, fused = (make_dag(2, edge_act, params, edges=edges, mode=m) for m in ("xla", "fused"))

    def loss(module, x, gates, expert_out):
        return jnp.sum(jnp.sin(module(x, gates, expert_out)[0]))

    grad = nnx.grad(loss, argnums=(0, 1, 2, 3))
    got, want = grad(fused, x, gates, expert_out), grad(xla, x, gates, expert_out)
    assert rel_err(fused(x, gates, expert_out)[0], xla(x, gates, expert_out)[0]) < 1e-6
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(b))) > 0
        assert rel_err(a, b) < 1e-5


def test_the_last_iteration_reads_out_the_summed_messages():
    """dag_summed_update applies W_up once to the messages summed over the nodes: the same as
    summing the K node updates of eq. 11 (W_up is linear), in values and gradients."""
    rng = np.random.default_rng(71)
    lp = {n: jnp.asarray(v[0]) for n, v in random_lib_params(rng, 1).items()}
    args = (lp["ln_scale"], lp["ln_bias"], lp["w_down"], lp["w_edge"], lp["w_node"], lp["w_up"])
    nodes = jnp.asarray(rng.normal(size=(T, 4, D)).astype(np.float32))

    def summed(nodes, *w):
        return dag_summed_update(nodes, *w, edge_act="silu", eps=EPS)

    def per_node(nodes, *w):
        return jnp.sum(dag_node_update(nodes, *w, edge_act="silu", eps=EPS), axis=1)

    assert summed(nodes, *args).shape == (T, D)
    assert rel_err(summed(nodes, *args), per_node(nodes, *args)) < 1e-6
    ct = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
    g_sum = jax.vjp(summed, nodes, *args)[1](ct)
    g_node = jax.vjp(per_node, nodes, *args)[1](ct)
    for a, b in zip(g_sum, g_node):
        assert rel_err(a, b) < 1e-5


def test_the_execution_is_a_strategy_chosen_once():
    """Every settled ``ExecutionConfig.dag_module`` names one strategy, which the module keeps
    (a clone's is equal, so a cloned model's graph is the same); an unsettled or unknown name
    is one line; the equations take no execution flags."""
    import inspect
    from dagmoe_jax.config.execution import DAG_MODULES
    from dagmoe_jax.families.moe.dag import equations, module

    assert set(DAG_EXECUTIONS) == set(DAG_MODULES) - {"auto"}
    for mode in MODES:
        dag = make_dag(2, "silu", mode=mode)
        assert dag.ex is dag_execution(mode) and dag.ex.name == mode
        assert nnx.graphdef(nnx.clone(dag)) == nnx.graphdef(dag)
    # the L-th iteration with the readout but on TPU, whose tiled layouts paid for the split
    assert {m: make_dag(2, "silu", mode=m).ex.last_with_readout for m in ("fused", "xla",
            "xla_rank3")} == {"fused": True, "xla": True, "xla_rank3": False}
    with pytest.raises(ValueError, match=r"^ExecutionConfig.dag_module='auto' is not settled"):
        dag_execution("auto")
    for mod in (equations, module):
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            assert not {"fused", "flat"} & set(inspect.signature(fn).parameters), name


def test_the_kernels_refuse_what_they_cannot_run_in_one_line():
    with pytest.raises(ValueError, match=r"^the DAG module kernels take float32 only \(got "
                                         r"bfloat16\); use ExecutionConfig.dag_module='xla' "
                                         r"instead$"):
        fused_layer_norm(jnp.ones((4, 32), jnp.bfloat16), jnp.ones(32), jnp.zeros(32), EPS)
    with pytest.raises(ValueError, match=r"take d_g a multiple of 16 \(got 12\)"):
        fused_dag_messages(jnp.ones((2, 3, 48)))
    with pytest.raises(ValueError, match=r"expected proj \[T, K, 4 d_g\], got \(2, 50\)"):
        fused_dag_messages(jnp.ones((2, 50)))


def test_the_one_pass_layer_norm_is_eq_7():
    """TPU's strategy takes eq. 7's statistics in one pass (var = E[x^2] - E[x]^2, Flax's
    default): equal to the NumPy transcription and to the two-pass LayerNorm, values and
    gradients, also with the nodes' mean well away from zero."""
    import functools

    from dagmoe_jax.families.moe.dag.equations import layer_norm

    layer_norm_one_pass = functools.partial(layer_norm, one_pass=True)

    rng = np.random.default_rng(7)
    scale, bias = rng.normal(size=64), rng.normal(size=64)
    for offset in (0.0, 8.0):
        x = rng.normal(size=(16, 64)) * 0.5 + offset
        want = np.stack([np_layer_norm(row, scale, bias, EPS) for row in x])
        args = [jnp.asarray(a, jnp.float32) for a in (x, scale, bias)]
        got = layer_norm_one_pass(*args, EPS)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
        probe = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
        grads = [jax.grad(lambda *a: jnp.sum(fn(*a, EPS) * probe), argnums=(0, 1, 2))(*args)
                 for fn in (layer_norm_one_pass, layer_norm)]
        for one, two in zip(*grads):
            np.testing.assert_allclose(np.asarray(one), np.asarray(two), rtol=1e-3, atol=1e-3)
    assert layer_norm_one_pass(jnp.ones((2, 8)) * 3.0, jnp.ones(8), jnp.zeros(8), EPS).sum() == 0
