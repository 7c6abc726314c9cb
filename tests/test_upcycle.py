"""MoErging, oracle routing, the statistics pass and DAG upcycling (dagmoe_jax/upcycle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.model.settle import settle
from dagmoe_jax.upcycle import dume, moerge, ridge

N = 3


def dense_models(seeds=(0, 1, 2)):
    cfg = tiny_config("dense")
    return [make_model(cfg, seed=s) for s in seeds]


def merged_config(top_k=1, **kw):
    return moerge.dume_config(tiny_config("dense"), N, top_k=top_k, **kw)


def merge(models, cfg, **kw):
    """``moerge.moerge`` run as the upcycling command runs it (settled for this machine)."""
    return moerge.moerge(models, cfg, execution=settle(cfg), **kw)


def tokens(seed=0, shape=(2, 16)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 64, shape))


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_identical_dense_models_merge_into_an_equal_moe(top_k):
    model = dense_models((5,))[0]
    moe = merge([model] * N, merged_config(top_k), seed=top_k)
    # any router: softmax gates over identical experts sum to one
    w = moe.layers.block.router.w_router
    w[...] = jax.random.normal(jax.random.key(top_k), w.shape)
    toks = tokens()
    np.testing.assert_allclose(np.asarray(moe(toks)[0]), np.asarray(model(toks)[0]),
                               rtol=1e-5, atol=1e-5)


def test_oracle_routing_equals_each_dense_model_with_the_shared_weights():
    models = dense_models()
    moe = merge(models, merged_config(2))
    shared, _ = moerge.merged_params([moerge.flat_params(m) for m in models])
    toks = tokens(1)
    for j, model in enumerate(models):
        reference = nnx.clone(model)
        moerge.set_params(reference, shared)             # dense model j, non-MLP averaged
        got, inputs = dume.forced_forward(moe, toks, jnp.int32(j))
        np.testing.assert_allclose(np.asarray(got), np.asarray(reference(toks)[0]),
                                   rtol=1e-5, atol=1e-5)
        assert inputs.shape == (2, 2, 16, 32)
    # the experts differ, so the oracle's choice matters (the equality is not vacuous)
    a = np.asarray(dume.forced_forward(moe, toks, jnp.int32(0))[0])
    assert np.max(np.abs(a - np.asarray(dume.forced_forward(moe, toks, jnp.int32(1))[0]))) > 1e-3


def test_forced_forward_keeps_packed_examples_apart():
    """Instruction statistics come in packed rows: with segment ids each example's MLP inputs
    are those of the example alone."""
    moe = merge(dense_models(), merged_config(1))
    toks = np.asarray(tokens(3, (1, 16)))
    segments = np.asarray([[1] * 6 + [2] * 7 + [0] * 3], np.int32)
    _, packed = dume.forced_forward(moe, jnp.asarray(toks), jnp.int32(0),
                                    segment_ids=jnp.asarray(segments))
    for lo, hi in ((0, 6), (6, 13)):
        _, alone = dume.forced_forward(moe, jnp.asarray(toks[:, lo:hi]), jnp.int32(0))
        np.testing.assert_allclose(np.asarray(packed)[:, :, lo:hi], np.asarray(alone),
                                   rtol=1e-5, atol=1e-5)
    _, unpacked = dume.forced_forward(moe, jnp.asarray(toks), jnp.int32(0))
    assert np.max(np.abs(np.asarray(unpacked)[:, :, 6:13] - np.asarray(packed)[:, :, 6:13])) > 1e-4


def test_statistics_pass_matches_the_forced_inputs_and_masks_padding():
    models = dense_models()
    moe = merge(models, merged_config(1))
    toks = np.asarray(tokens(2, (2, 16)))
    mask = np.ones((2, 16), bool)
    mask[1, 10:] = False
    seen = []
    stats = dume.collect_statistics(moe, [{"inputs": toks, "mask": mask}], 1,
                                    tokens_per_sequence=12, on_host=True,
                                    progress=lambda b, t: seen.append((b, t)))
    _, x = dume.forced_forward(moe, jnp.asarray(toks), jnp.int32(1))
    keep = mask & (np.arange(16) < 12)
    x = np.asarray(x, np.float64)[:, keep]                             # [layers, T, d]
    xt = np.concatenate([x, np.ones(x.shape[:2] + (1,))], axis=-1)
    np.testing.assert_allclose(stats.gram, np.einsum("ltd,lte->lde", xt, xt), rtol=1e-12)
    np.testing.assert_allclose(stats.total, xt.sum(1), rtol=1e-12)
    assert stats.tokens == keep.sum() == 22 and seen == [(1, 22)]


def test_device_statistics_equal_the_float64_host_ones_within_float32_rounding():
    """X^T X accumulated on the device (float32 matmul per batch, Kahan sum over batches) vs
    the float64 host sum of the same float32 inputs. Bound: a float32 dot product of n terms
    errs by at most gamma_n |x|.|y| (Higham, Accuracy and Stability, eq. 3.5; gamma_n =
    n u / (1 - n u), u = 2^-24), n = one batch's tokens, since compensation keeps the sum over
    batches at ~u; this is the size of the forward pass's own float32 rounding of x."""
    moe = merge(dense_models(), merged_config(1))
    batches = []
    for i in range(12):
        toks = np.asarray(tokens(30 + i, (2, 16)))
        mask = np.ones((2, 16), bool)
        mask[i % 2, 3 + i:] = False
        batches.append({"inputs": toks, "mask": mask})
    host = dume.collect_statistics(moe, batches, 2, tokens_per_sequence=14, on_host=True)
    seen = []
    device = dume.collect_statistics(moe, batches, 2, tokens_per_sequence=14,
                                     progress=lambda b, t: seen.append(t))
    assert device.tokens == host.tokens and seen[-1] == host.tokens
    absolute = np.zeros_like(host.gram)
    for b in batches:                           # |X~|^T |X~| over all tokens
        _, x = dume.forced_forward(moe, jnp.asarray(b["inputs"]), jnp.int32(2))
        keep = dume.token_mask(b, 14)
        x = np.abs(np.asarray(x, np.float64)[:, keep])
        xt = np.concatenate([x, np.ones(x.shape[:2] + (1,))], axis=-1)
        absolute += np.einsum("ltd,lte->lde", xt, xt)
    n, u = 32, 2.0 ** -24
    gamma = n * u / (1 - n * u) + 4 * u                 # one batch's matmul + the Kahan sum
    assert np.all(np.abs(device.gram - host.gram) <= gamma * absolute)
    assert np.all(np.abs(device.total - host.total) <= gamma * absolute[:, -1])
    w_host, _ = ridge.solve_routers([host] * 2)
    w_device, _ = ridge.solve_routers([device] * 2)
    np.testing.assert_allclose(w_device, w_host, rtol=1e-3, atol=1e-4)


def test_dume_routers_are_the_normalised_ridge_solution():
    models = dense_models()
    moe = merge(models, merged_config(1))
    stats = [dume.collect_statistics(moe, [{"inputs": np.asarray(tokens(10 + j))}], j)
             for j in range(N)]
    dume.dume(moe, stats)
    w, b = ridge.solve_routers(stats)
    np.testing.assert_allclose(np.asarray(moe.layers.block.router.w_router[...]), w,
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(moe.layers.block.router.b_router[...]), b,
                               rtol=1e-6, atol=1e-7)


def test_upcycled_dag_starts_equal_to_dume():
    models = dense_models()
    moe = merge(models, merged_config(2))
    for name in ("w_router", "b_router"):
        v = getattr(moe.layers.block.router, name)
        v[...] = jax.random.normal(jax.random.key(7), v.shape)
    dag = dume.upcycle_to_dag(moe, dag_dim=16, dag_iters=2)
    assert dag.cfg.block.aggregation.kind == "dag"
    toks = tokens(3)
    want = np.asarray(moe(toks)[0])
    np.testing.assert_allclose(np.asarray(dag(toks)[0]), want, rtol=1e-5, atol=1e-5)
    w_up = dag.layers.block.aggregator.iterations.w_up
    w_up[...] = 0.5 * jax.random.normal(jax.random.key(2), w_up.shape)
    assert np.max(np.abs(np.asarray(dag(toks)[0]) - want)) > 1e-3
    with pytest.raises(ValueError, match="dag_residual='literal'"):
        dume.upcycle_to_dag(moe, dag_dim=16, dag_residual="literal")


def test_bad_merges_are_one_line_errors():
    dense = tiny_config("dense")
    with pytest.raises(ValueError, match="dispatch='capacity' is invalid"):
        moerge.check_dume_config(moerge.dume_config(dense, N).replace(
            block=dict(experts=dict(dispatch="capacity"))))
    with pytest.raises(ValueError, match="top_k=4"):
        moerge.dume_config(dense, N, top_k=4)
    with pytest.raises(ValueError, match="DUME merges dense models"):
        moerge.dume_config(tiny_config("moe"), N)
    other = make_model(tiny_config("dense", ffn_hidden=48))
    with pytest.raises(ValueError,
                       match="ModelConfig.block.ffn_hidden=48 but model 0 has 64") as err:
        merge(dense_models((0,)) + [other], merged_config(1))
    assert "\n" not in str(err.value)


def test_router_only_training_moves_only_the_routers():
    import optax
    from dagmoe_jax.run.config import RunConfig
    from dagmoe_jax.run.optim import TRAINABLE, check_trainable
    from dagmoe_jax.train.step import make_train_step

    moe = merge(dense_models(), merged_config(2))
    before = moerge.flat_params(moe)
    optimizer = nnx.Optimizer(moe, optax.adam(1e-2), wrt=TRAINABLE["router"])
    step = make_train_step(wrt=TRAINABLE["router"])
    toks = np.asarray(tokens(4, (2, 17)))
    batch = {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:])}
    metrics = step(moe, optimizer, batch)
    assert float(metrics["grad_norm"]) > 0
    after = moerge.flat_params(moe)
    for path, value in before.items():
        moved = not np.array_equal(value, after[path])
        assert moved == ("router" in path), path
    with pytest.raises(ValueError, match="top_k=1 and renormalize=True"):
        check_trainable(merged_config(1), "router")
    with pytest.raises(ValueError, match="dense model"):
        check_trainable(tiny_config("dense"), "router")
    with pytest.raises(ValueError, match="RunConfig.trainable='some'"):
        RunConfig(trainable="some")


@pytest.mark.parametrize("top_k", [1, 2])
def test_router_and_gates_moves_exactly_the_routers_and_the_experts_w_gate(top_k):
    """The authors' trainable set. At top_k = 1 the renormalised gate g / g of the one chosen
    expert is 1, so the router's gradient is exactly zero and only the w_gate move."""
    import optax
    from dagmoe_jax.run.optim import TRAINABLE, check_trainable
    from dagmoe_jax.train.step import make_train_step
    from dagmoe_jax.upcycle.command import default_trainable

    moe = merge(dense_models(), merged_config(top_k))
    before = moerge.flat_params(moe)
    wrt = TRAINABLE["router_and_gates"]
    optimizer = nnx.Optimizer(moe, optax.adam(1e-2), wrt=wrt)
    toks = np.asarray(tokens(4, (2, 17)))
    batch = {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:])}
    assert float(make_train_step(wrt=wrt)(moe, optimizer, batch)["grad_norm"]) > 0
    after = moerge.flat_params(moe)
    moved = {p for p, v in before.items() if not np.array_equal(v, after[p])}
    gates = {p for p in before if "experts" in p and p[-1] == "w_gate"}
    routers = {p for p in before if "router" in p}
    assert gates and routers
    assert moved == (gates | routers if top_k == 2 else gates), sorted(moved)
    check_trainable(merged_config(1), "router_and_gates")          # allowed at top-1
    with pytest.raises(ValueError, match="dense model"):
        check_trainable(tiny_config("dense"), "router_and_gates")
    assert default_trainable(merged_config(top_k)) == ("router" if top_k == 2
                                                       else "router_and_gates")


def test_adding_a_domain_keeps_the_old_statistics_and_equals_a_fresh_solve():
    models = dense_models((0, 1, 2, 3))
    moe = merge(models[:N], merged_config(1))
    batches = [[{"inputs": np.asarray(tokens(20 + j))}] for j in range(N + 1)]
    old = [dume.collect_statistics(moe, batches[j], j) for j in range(N)]
    grown = dume.add_expert(moe, models[N])
    assert grown.cfg.block.experts.num_experts == N + 1
    new = dume.collect_statistics(grown, batches[N], N)
    dume.dume(grown, old + [new])
    fresh = [dume.collect_statistics(grown, batches[j], j) for j in range(N + 1)]
    for a, b in zip(old, fresh):                   # the old domains' passes are unchanged
        np.testing.assert_allclose(a.gram, b.gram, rtol=1e-6, atol=1e-6)
    w, b = ridge.solve_routers(fresh)
    np.testing.assert_allclose(np.asarray(grown.layers.block.router.w_router[...]), w,
                               rtol=1e-4, atol=1e-5)
    # the new expert is dense model N's MLP
    got = np.asarray(dume.forced_forward(grown, tokens(5), jnp.int32(N))[0])
    shared, _ = moerge.merged_params([moerge.flat_params(m) for m in models[:N]])
    reference = nnx.clone(models[N])
    moerge.set_params(reference, shared)
    np.testing.assert_allclose(got, np.asarray(reference(tokens(5))[0]), rtol=1e-5, atol=1e-5)


def test_adding_a_domain_with_reaveraging_equals_merging_all_models_afresh():
    models = dense_models((0, 1, 2, 3))
    moe = merge(models[:N], merged_config(2))
    grown = dume.add_expert(moe, models[N], reaverage=True)
    fresh = merge(models, moerge.dume_config(tiny_config("dense"), N + 1, top_k=2))
    got, want = moerge.flat_params(grown), moerge.flat_params(fresh)
    for path, value in want.items():
        if "router" not in path:          # float32 mean of a float32 mean: ~1 ulp
            np.testing.assert_allclose(got[path], value, rtol=1e-6, atol=1e-7, err_msg=path)
    # the shared weights moved, so the old domains' forced passes (their statistics) change
    kept = dume.add_expert(moe, models[N])
    a, b = (np.asarray(dume.forced_forward(m, tokens(6), jnp.int32(0))[0]) for m in (grown, kept))
    assert np.max(np.abs(a - b)) > 1e-4
