"""The full decoder for every block type: causality, gradients, training, compilation, aux outputs,
blockwise attention and rematerialisation.

Compiling a tiny decoder still takes seconds on CPU, so each configuration gets one cached
harness holding one jitted forward and one jitted train step, shared by the tests below; fresh
models of the same structure reuse the compiled code (nnx.jit caches on the graph structure).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import make_model, tiny_config, tiny_execution
from dagmoe_jax.model.attention import blockwise_causal_attention, causal_attention_reference
from dagmoe_jax.model.block import BlockInputs
from dagmoe_jax.families.coe.block import CoEBlock
from dagmoe_jax.families.moe.block import MoEBlock
from dagmoe_jax.model.settle import settle_remat, settle_scan_unroll

BATCH, SEQ = 2, 16

# capacity_factor = num_experts gives C = T * K slots per expert, so capacity dispatch never drops
# a token. That matters for causality: with drops, whether token t keeps its expert depends on
# the routing of every other token in the batch (including later ones), which is a legitimate
# coupling of capacity dispatch, not an attention leak.
NO_DROP = dict(capacity_factor=4.0)

CONFIGS = {
    "dense": tiny_config("dense"),
    "moe-sum": tiny_config("moe", "sum", experts=NO_DROP),
    "moe-dag": tiny_config("moe", "dag", experts=NO_DROP),
    "moe-mlp": tiny_config("moe", "mlp", experts=NO_DROP),
    "moe-sum-shared": tiny_config("moe", "sum", experts=dict(num_shared=1, **NO_DROP)),
    "moe-dag-shared": tiny_config("moe", "dag", experts=dict(num_shared=1, **NO_DROP)),
    "coe": tiny_config("coe", experts=NO_DROP),
    "coe-outer": tiny_config("coe", experts=NO_DROP, coe=dict(residual="outer")),
    "coe-init": tiny_config("coe", experts=NO_DROP, coe=dict(residual="init")),
    "coe-shared-router": tiny_config("coe", experts=NO_DROP, coe=dict(shared_router=True)),
}
ROUTED = [name for name, cfg in CONFIGS.items() if cfg.block.kind != "dense"]


def loss_fn(model, tokens):
    """Next-token cross-entropy plus the model's weighted router losses."""
    logits, aux = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce + aux["aux_loss"], aux


def randomize_zero_inits(model, seed=0, std=0.1):
    """Give the zero-initialised output projections (DAG W_up, MLP-mixer W_3) random values.

    With W_up = 0 the DAG's output does not depend on W_down, W_edge, W_node or its LayerNorm,
    so their gradients are exactly zero at initialisation (likewise W_1, W_2 behind W_3 = 0).
    That is the intended zero-init, not a broken graph; randomising the projections first lets
    the gradient test see every parameter.
    """
    key = jax.random.key(seed)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and "aggregator" in path and path[-1] in ("w_up", "w_3"):
            key, sub = jax.random.split(key)
            node[...] = std * jax.random.normal(sub, node.shape, node.dtype)


def random_tokens(seed, length=SEQ + 1):
    return jax.random.randint(jax.random.key(seed), (BATCH, length), 0, 64)


@dataclasses.dataclass
class Harness:
    cfg: object
    forward: object
    train_step: object
    traces: dict
    # One optax transformation per harness: it is static data of the optimizer's graph, and a
    # new adamw() (new closures) would be a new graph and so a new trace.
    tx: object = dataclasses.field(default_factory=lambda: optax.adamw(1e-2))
    execution: dict = dataclasses.field(default_factory=dict)   # ExecutionConfig fields

    def model(self, seed=0):
        return make_model(self.cfg, seed=seed, **self.execution)

    def optimizer(self, model):
        return nnx.Optimizer(model, self.tx, wrt=nnx.Param)


def make_harness(cfg, execution=None):
    traces = {"forward": 0, "train_step": 0}

    @nnx.jit
    def forward(model, tokens):
        traces["forward"] += 1
        return model(tokens)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        traces["train_step"] += 1
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)
        optimizer.update(model, grads)
        return loss, grads

    return Harness(cfg, forward, train_step, traces, execution=execution or {})


_HARNESSES: dict = {}


def get_harness(name, cfg=None, execution=None):
    """One harness (two compiled functions) per configuration name for the whole session."""
    if name not in _HARNESSES:
        _HARNESSES[name] = make_harness(cfg if cfg is not None else CONFIGS[name], execution)
    return _HARNESSES[name]


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def harness(request):
    return get_harness(request.param)


# ----------------------------------------------------------------------------- causality

def test_causality(harness):
    model = harness.model()
    randomize_zero_inits(model)         # let the DAG / mixer terms take part
    tokens = random_tokens(1, SEQ)
    base = np.asarray(harness.forward(model, tokens)[0])
    assert base.shape == (BATCH, SEQ, 64) and base.dtype == np.float32
    for t in (0, 6, 7, 12, SEQ - 2):   # 7 and 8 straddle an attention block boundary (block 8)
        changed = tokens.at[:, t + 1].set((tokens[:, t + 1] + 17) % 64)
        out = np.asarray(harness.forward(model, changed)[0])
        past = np.abs(out[:, :t + 1] - base[:, :t + 1]).max()
        now = np.abs(out[:, t + 1] - base[:, t + 1]).max()
        # The changed position itself moves by orders of magnitude more than the tolerance, so
        # a leak from the future would be visible.
        assert now > 1e-3, (t, now)
        assert past <= 1e-6 * np.abs(base).max(), (t, past)


def test_causality_dropless_dag():
    h = get_harness("moe-dag-dropless", tiny_config("moe", "dag", experts=dict(dispatch="dropless")))
    model = h.model()
    randomize_zero_inits(model)
    tokens = random_tokens(2, SEQ)
    base = np.asarray(h.forward(model, tokens)[0])
    t = 9
    out = np.asarray(h.forward(model, tokens.at[:, t + 1].set((tokens[:, t + 1] + 5) % 64))[0])
    assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max() > 1e-3
    np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], rtol=0,
                               atol=1e-6 * np.abs(base).max())


# ----------------------------------------------------------------------------- gradients

def test_gradients_reach_every_parameter(harness):
    model = harness.model()
    randomize_zero_inits(model)
    optimizer = harness.optimizer(model)
    _, grads = harness.train_step(model, optimizer, random_tokens(3))
    flat = nnx.to_flat_state(grads)
    n_params = len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert len(flat) == n_params > 0
    for path, g in flat:
        g = np.asarray(g[...] if hasattr(g, "get_value") else g)
        assert np.all(np.isfinite(g)), path
        assert np.any(g != 0), f"zero gradient for {path}"
        if path[0] == "layers":
            # Stacked over layers: every layer's slice (and every DAG iteration's) gets gradient.
            per_layer = g.reshape(g.shape[0], -1) if "iterations" not in path else \
                g.reshape(g.shape[0] * g.shape[1], -1)
            assert np.all(np.any(per_layer != 0, axis=1)), f"a layer/iteration of {path} is 0"


def test_zero_init_blocks_dag_gradients_as_expected():
    """At initialisation (W_up = 0) the DAG's inner weights get exactly zero gradient while W_up's
    is non-zero: the documented reason the gradient test randomises W_up first."""
    h = get_harness("moe-dag")
    model = h.model()
    _, grads = h.train_step(model, h.optimizer(model), random_tokens(4))
    it = grads["layers"]["block"]["aggregator"]["iterations"]
    for name in ("w_down", "w_edge", "w_node", "ln_scale", "ln_bias"):
        assert np.all(np.asarray(it[name][...]) == 0), name
    assert np.any(np.asarray(it["w_up"][...]) != 0)


# ----------------------------------------------------------------------------- training

def test_one_optimizer_step_lowers_the_loss(harness):
    model = harness.model()
    optimizer = harness.optimizer(model)
    tokens = random_tokens(5)
    before, _ = harness.train_step(model, optimizer, tokens)    # loss before the update
    after, _ = harness.train_step(model, optimizer, tokens)     # loss after one update
    assert np.isfinite(float(before)) and np.isfinite(float(after))
    assert float(after) < float(before) - 1e-3, (float(before), float(after))
    assert int(optimizer.step[...]) == 2


def test_jit_compiles_once(harness):
    model = harness.model(seed=1)
    optimizer = harness.optimizer(model)
    losses = [float(harness.train_step(model, optimizer, random_tokens(10 + i))[0])
              for i in range(3)]
    for i in range(3):
        harness.forward(model, random_tokens(20 + i, SEQ))
    # Each step changes the parameter values and the optimizer state, and the data is new each
    # time; none of that may retrace. (Counts are per harness, across every test that uses it,
    # all with these shapes and fresh models of the same structure.)
    assert harness.traces["train_step"] == 1
    assert harness.traces["forward"] == 1
    assert len(set(losses)) == 3


# ----------------------------------------------------------------------------- aux outputs

def test_aux_outputs(harness):
    cfg = harness.cfg
    model = harness.model()
    _, aux = harness.forward(model, random_tokens(6, SEQ))
    assert set(aux) == {"balance_loss", "z_loss", "aux_loss", "expert_load", "dropped_fraction"}
    layers = cfg.num_layers
    n = cfg.block.experts.num_experts if cfg.block.kind != "dense" else 0   # no experts: [L, 0]
    assert aux["expert_load"].shape == (layers, n)
    assert aux["dropped_fraction"].shape == (layers,)
    assert aux["balance_loss"].shape == aux["z_loss"].shape == aux["aux_loss"].shape == ()
    load = np.asarray(aux["expert_load"])
    if cfg.block.kind == "dense":
        for name in aux:
            np.testing.assert_array_equal(np.asarray(aux[name]), 0.0, err_msg=name)
        return
    np.testing.assert_allclose(load.sum(axis=1), 1.0, rtol=1e-6)
    assert np.all(load >= 0)
    np.testing.assert_array_equal(np.asarray(aux["dropped_fraction"]), 0.0)   # C = T * K
    np.testing.assert_allclose(float(aux["aux_loss"]),
                               cfg.block.router.balance_coef * float(aux["balance_loss"])
                               + cfg.block.router.z_loss_coef * float(aux["z_loss"]), rtol=1e-6)
    # Near-uniform routing at init: balance loss near its balanced value K (f over tokens, the
    # default RouterConfig.balance_load), z-loss near (log N)^2 because the logits are near 0.
    k = cfg.block.resolved_top_k if cfg.block.kind == "coe" else cfg.block.router.top_k
    assert 0.8 * k < float(aux["balance_loss"]) < 1.5 * k
    np.testing.assert_allclose(float(aux["z_loss"]), np.log(n) ** 2, rtol=0.05)


def test_dropped_fraction_reported_per_layer():
    cfg = tiny_config("moe", "sum", experts=dict(capacity_factor=0.25, dispatch="capacity"))
    model = make_model(cfg)
    _, aux = nnx.jit(lambda m, t: m(t))(model, random_tokens(7, SEQ))
    dropped = np.asarray(aux["dropped_fraction"])
    # C = ceil(0.25 * 32 * 2 / 4) = 4 slots per expert hold at most 16 of the 64 assignments.
    assert dropped.shape == (2,)
    assert np.all(dropped >= 0.75 - 1e-6) and np.all(dropped < 1)


# ----------------------------------------------------------------------------- attention

@pytest.mark.parametrize("seq,block", [(21, 8), (16, 8), (5, 8)])
def test_blockwise_attention_matches_references(seq, block):
    b, h, kv, d = 2, 4, 2, 8
    kq, kk, kv_ = jax.random.split(jax.random.key(seq), 3)
    q = jax.random.normal(kq, (b, seq, h, d))
    k = jax.random.normal(kk, (b, seq, kv, d))
    v = jax.random.normal(kv_, (b, seq, kv, d))
    got = np.asarray(jax.jit(blockwise_causal_attention, static_argnums=3)(q, k, v, block))
    ref = np.asarray(jax.jit(causal_attention_reference)(q, k, v))
    xla = np.asarray(jax.jit(partial(jax.nn.dot_product_attention, is_causal=True))(q, k, v))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-6)
    # And an explicit NumPy oracle: query head j uses KV head j // (h // kv).
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros_like(qn)
    for bi in range(b):
        for j in range(h):
            s = qn[bi, :, j] @ kn[bi, :, j // (h // kv)].T / np.sqrt(d)
            s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[bi, :, j] = (p / p.sum(-1, keepdims=True)) @ vn[bi, :, j // (h // kv)]
    np.testing.assert_allclose(got, out, rtol=1e-5, atol=1e-6)
    # Gradients (w.r.t. q, k and v) agree with the full reference too.
    cot = jax.random.normal(jax.random.key(seq + 1), q.shape)
    grad_of = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * cot),
                                         argnums=(0, 1, 2)))(q, k, v)
    g_block = grad_of(lambda q, k, v: blockwise_causal_attention(q, k, v, block))
    g_ref = grad_of(causal_attention_reference)
    for name, a, r in zip("qkv", g_block, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5,
                                   err_msg=f"d{name}")


# ----------------------------------------------------------------------------- remat

# The moe-dag harness runs the defaults: remat 'auto' and scan_unroll 0, on CPU no recomputation
# and the layer loop unrolled. The rolled scan (one compiled layer body, the accelerator default)
# and each remat policy must give the same loss and gradients.
LAYER_LOOPS = {
    "none-scan": dict(remat="none", scan_unroll=1),
    "full-scan": dict(remat="full", scan_unroll=1),
    "dots": dict(remat="dots"),
}


def test_auto_remat_and_unroll_settle_per_backend():
    assert settle_remat("auto", "cpu") == "none" and settle_scan_unroll(0, 4, "cpu") == 4
    assert settle_remat("auto", "gpu") == "full" and settle_scan_unroll(0, 4, "tpu") == 1
    for name in ("none", "full", "dots"):
        assert settle_remat(name, "cpu") == settle_remat(name, "gpu") == name
    assert settle_scan_unroll(1, 4, "cpu") == 1 and settle_scan_unroll(2, 4, "gpu") == 2


def test_remat_policies_and_layer_loops_match():
    results = {}
    tokens = random_tokens(8)
    for name, changes in {"auto": {}, **LAYER_LOOPS}.items():
        h = get_harness("moe-dag" if name == "auto" else f"moe-dag-{name}",
                        CONFIGS["moe-dag"], changes)
        model = h.model()                                   # same seed: same parameters
        randomize_zero_inits(model)
        loss, grads = h.train_step(model, h.optimizer(model), tokens)   # pre-update values
        results[name] = (float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads)))
    loss0, grads0 = results["auto"]
    for name in LAYER_LOOPS:
        loss, grads = results[name]
        np.testing.assert_allclose(loss, loss0, rtol=1e-6)
        flat0 = jax.tree_util.tree_leaves_with_path(grads0)
        flat = jax.tree_util.tree_leaves_with_path(grads)
        assert [p for p, _ in flat] == [p for p, _ in flat0]
        for (path, g), (_, g0) in zip(flat, flat0):
            scale = np.abs(g0).max()
            assert scale > 0, path
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5 * scale,
                                       err_msg=f"{name} {jax.tree_util.keystr(path)}")


# ----------------------------------------------------------------------------- block semantics

def np_swiglu(x, w_gate, w_up, w_down):
    a, b = x @ w_gate, x @ w_up
    return (a / (1 + np.exp(-a)) * b) @ w_down


def np_route(h, w_router, k, score_fn):
    """Scores and top-k (descending, ties to the lower index) in float64."""
    z = h @ w_router
    s = 1 / (1 + np.exp(-z)) if score_fn == "sigmoid" else \
        np.exp(z - z.max(1, keepdims=True)) / np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)
    idx = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, idx, axis=1), idx


def np_routed_sum(h, gates, idx, experts):
    w = [np.asarray(v[...], np.float64) for v in (experts.w_gate, experts.w_up, experts.w_down)]
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            out[t] += gates[t, j] * np_swiglu(h[t], w[0][e], w[1][e], w[2][e])
    return out


def np_shared(h, shared):
    if shared is None:
        return 0.0
    return np_swiglu(h, *(np.asarray(v[...], np.float64)
                          for v in (shared.w_gate, shared.w_up, shared.w_down)))


@pytest.mark.parametrize("residual,shared_router,num_shared,score_fn,stream", [
    ("inner", False, 0, "sigmoid", "once"), ("outer", False, 0, "sigmoid", "once"),
    ("init", False, 0, "sigmoid", "literal"), ("inner", True, 0, "softmax", "literal"),
    ("init", False, 1, "softmax", "once"), ("outer", False, 1, "sigmoid", "reference")])
def test_coe_block_matches_manual_chain(residual, shared_router, num_shared, score_fn, stream):
    """CoE eq. 4-10 by hand: x^(t) = sum_i g_t,i E_i(x^(t-1)) (+ shared) + residual; the block
    returns the chain's output ('literal', 'reference') or that minus x ('once')."""
    cfg = tiny_config("coe", init_std=0.2, router=dict(top_k=4, score_fn=score_fn),
                      experts=dict(num_experts=8, num_shared=num_shared, capacity_factor=8.0),
                      coe=dict(iterations=2, residual=residual, shared_router=shared_router,
                               stream=stream))
    assert cfg.block.resolved_top_k == 2
    block = CoEBlock(cfg, tiny_execution(cfg), rngs=nnx.Rngs(3))
    assert len(block.routers) == (1 if shared_router else 2)
    x = jax.random.normal(jax.random.key(4), (2, 6, 32))
    y, stats = nnx.jit(lambda blk, v: blk(BlockInputs(v)))(block, x)

    x0 = np.asarray(x, np.float64).reshape(-1, 32)
    h = x0
    for t in range(2):
        if t == 0 or not shared_router:
            gates, idx = np_route(h, np.asarray(block.routers[t].w_router[...], np.float64), 2,
                                  score_fn)
        update = np_routed_sum(h, gates, idx, block.experts) + np_shared(h, block.shared)
        h = update + {"inner": h, "init": x0, "outer": 0.0}[residual]
    expected = h + x0 if residual == "outer" else h
    if stream == "once":
        expected = expected - x0
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 32), expected, rtol=1e-4,
                               atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(stats.expert_load).sum(), 1.0, rtol=1e-6)
    assert float(stats.dropped_fraction) == 0.0


@pytest.mark.parametrize("kind,num_shared", [("sum", 1), ("dag", 1), ("mlp", 0)])
def test_moe_block_matches_manual(kind, num_shared):
    """y = Aggregate(x, g, E(x)) + shared(x), with the routing and experts recomputed by hand."""
    cfg = tiny_config("moe", kind, init_std=0.2, router=dict(top_k=3),
                      experts=dict(num_experts=6, num_shared=num_shared, capacity_factor=6.0))
    block = MoEBlock(cfg, tiny_execution(cfg), rngs=nnx.Rngs(5))
    if kind != "sum":   # random zero-initialised projection, so the aggregator does something
        var = block.aggregator.iterations.w_up if kind == "dag" else block.aggregator.w_3
        var[...] = 0.2 * jax.random.normal(jax.random.key(6), var.shape)
    x = jax.random.normal(jax.random.key(7), (2, 5, 32))
    y, _ = nnx.jit(lambda blk, v: blk(BlockInputs(v)))(block, x)
    xt = np.asarray(x, np.float64).reshape(-1, 32)
    gates, idx = np_route(xt, np.asarray(block.router.w_router[...], np.float64), 3, "sigmoid")
    w = [np.asarray(v[...], np.float64) for v in (block.experts.w_gate, block.experts.w_up,
                                                   block.experts.w_down)]
    expert_out = np.stack([[np_swiglu(xt[t], w[0][e], w[1][e], w[2][e]) for e in idx[t]]
                           for t in range(xt.shape[0])])
    if kind == "sum":
        agg = np.einsum("tk,tkd->td", gates, expert_out)
    else:   # the aggregators themselves are checked against the paper in test_dag.py
        agg = np.asarray(block.aggregator(jnp.asarray(xt, jnp.float32),
                                          jnp.asarray(gates, jnp.float32),
                                          jnp.asarray(expert_out, jnp.float32))[0], np.float64)
    expected = agg + np_shared(xt, block.shared)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 32), expected, rtol=1e-4,
                               atol=1e-5 * np.abs(expected).max())


def test_too_long_sequence_is_a_clear_error():
    cfg = tiny_config("moe", "sum", max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        make_model(cfg)(jnp.zeros((1, 17), jnp.int32))


@pytest.mark.parametrize("block, aggregation", [("dense", None), ("moe", "dag"),
                                                ("moe", "mlp"), ("coe", None)])
def test_param_dtype_is_every_matrix_dtype(block, aggregation):
    """``ModelConfig.param_dtype='bfloat16'`` stores every matrix in bfloat16 (the experts, the
    dense and shared FFNs, the aggregators' matrices, attention, embeddings); norm scales and
    biases and the routers stay float32; the model still runs and computes in its
    ``compute_dtype``."""
    cfg = (tiny_config(block, aggregation, experts=dict(num_shared=1)) if aggregation
           else tiny_config(block))
    model = make_model(cfg.replace(param_dtype="bfloat16"))
    dtypes = {jax.tree_util.keystr(path): x.dtype for path, x in
              jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}
    kept = {k for k, dt in dtypes.items() if dt == jnp.float32}
    assert kept and all(("norm" in k or "ln_" in k or "router" in k) for k in kept), kept
    assert all(dt == jnp.bfloat16 for k, dt in dtypes.items() if k not in kept)
    assert any("expert" in k or "w_gate" in k for k in dtypes if k not in kept)
    logits = model(jnp.zeros((2, 8), jnp.int32))[0]
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
