"""Dispatch strategies (capacity, dropless, dense), the capacity priority rule, and MoEBlock."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config, tiny_execution
from dagmoe_jax.model.routed.dispatch import (DispatchPlan, capacity_dispatch, capacity_slots,
                                              dense_dispatch, dispatch, dropless_dispatch,
                                              expert_capacity)
from dagmoe_jax.config import ExecutionConfig, ExpertConfig
from dagmoe_jax.model.routed.experts import Experts
from dagmoe_jax.model.block import BlockInputs
from dagmoe_jax.families.moe.block import MoEBlock

N, D, H = 4, 16, 24


def random_weights(rng, n=N, d=D, h=H):
    f = lambda *s: jnp.asarray(rng.normal(scale=1 / np.sqrt(s[-2]), size=s).astype(np.float32))
    return f(n, d, h), f(n, d, h), f(n, h, d)


def np_expert_outputs(x, indices, weights):
    """Oracle: for each (token, rank) run that expert's SwiGLU on that token, in float64."""
    w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in weights)
    x = np.asarray(x, np.float64)
    t, k = indices.shape
    out = np.zeros((t, k, x.shape[1]))
    for ti in range(t):
        for ki in range(k):
            e = int(indices[ti, ki])
            a, b = x[ti] @ w_gate[e], x[ti] @ w_up[e]
            out[ti, ki] = (a / (1 + np.exp(-a)) * b) @ w_down[e]
    return out


def random_routing(rng, t, k, n=N):
    """Distinct experts per token, like top-k produces."""
    return np.stack([rng.permutation(n)[:k] for _ in range(t)]).astype(np.int32)


def test_expert_capacity_formula():
    assert expert_capacity(10, 2, 4, 1.25) == 7            # ceil(6.25)
    assert expert_capacity(8, 2, 4, 1.0) == 4              # exact: not rounded up
    assert expert_capacity(12, 2, 8, 1.1) == 4             # ceil(3.3)
    assert expert_capacity(1, 1, 64, 1.0) == 1             # at least one slot
    assert expert_capacity(32, 2, 4, 4.0) == 64            # factor N: C = T * K, nothing drops
    for t, k, n, cf in [(7, 3, 5, 0.7), (100, 8, 64, 1.25), (2048, 4, 32, 2.0)]:
        assert expert_capacity(t, k, n, cf) == max(1, math.ceil(cf * t * k / n))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dispatch_modes_agree_when_nothing_drops(k):
    rng = np.random.default_rng(k)
    t = 24
    x = jnp.asarray(rng.normal(size=(t, D)).astype(np.float32))
    indices_np = random_routing(rng, t, k)
    indices = jnp.asarray(indices_np)
    weights = random_weights(rng)
    oracle = np_expert_outputs(x, indices_np, weights)
    # capacity_factor N gives C = T * K slots per expert: even if every assignment chose the
    # same expert nothing could drop.
    outs = {
        "capacity": jax.jit(capacity_dispatch, static_argnums=3)(x, indices, weights, float(N)),
        "dropless": jax.jit(dropless_dispatch)(x, indices, weights),
        "dense": jax.jit(dense_dispatch)(x, indices, weights),
    }
    for mode, (out, keep) in outs.items():
        assert out.shape == (t, k, D), mode
        assert keep.shape == (t, k) and bool(jnp.all(keep)), mode
        np.testing.assert_allclose(np.asarray(out), oracle, rtol=1e-5, atol=1e-5, err_msg=mode)
    for mode in ("capacity", "dropless"):
        np.testing.assert_allclose(np.asarray(outs[mode][0]), np.asarray(outs["dense"][0]),
                                   rtol=1e-5, atol=1e-6, err_msg=mode)
    # A plan routes to the same functions: its experts' mode and capacity, its execution's
    # grouped matmul ('einsum': every expert on every token)
    plans = {"capacity": ExpertConfig(dispatch="capacity", capacity_factor=float(N)),
             "dropless": ExpertConfig(dispatch="dropless")}
    for mode, experts in plans.items():
        out, _ = dispatch(DispatchPlan(experts), x, indices, weights)
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[mode][0]), rtol=1e-6,
                                   atol=1e-6, err_msg=mode)
    dense = DispatchPlan(plans["dropless"],
                         ExecutionConfig(fuse_projections=True, grouped_matmul="einsum"))
    assert dense.dense and not DispatchPlan(plans["dropless"]).dense
    np.testing.assert_allclose(np.asarray(dispatch(dense, x, indices, weights)[0]),
                               np.asarray(outs["dense"][0]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("capacity_factor", [4.0, 0.5])
def test_dispatch_gradients_match_dense(capacity_factor):
    """Gradients through capacity (with and without drops) and dropless dispatch, w.r.t. the
    tokens and every expert weight, equal those of the dense oracle with dropped assignments
    masked out. (Both gathers in these paths carry a hand-written VJP.)"""
    rng = np.random.default_rng(42)
    t, k = 12, 2
    x = jnp.asarray(rng.normal(size=(t, D)).astype(np.float32))
    indices_np = random_routing(rng, t, k)
    indices_np[:7, 0] = 0                       # crowd expert 0 so that the small capacity drops
    indices_np[:7, 1] = np.where(indices_np[:7, 1] == 0, 1, indices_np[:7, 1])
    indices = jnp.asarray(indices_np)
    weights = random_weights(rng)
    cot = jnp.asarray(rng.normal(size=(t, k, D)).astype(np.float32))

    def objective(fn, x, weights):
        out, keep = fn(x, weights)
        return jnp.sum(out * cot), keep

    cap_fn = lambda x, w: capacity_dispatch(x, indices, w, capacity_factor)
    (_, keep), cap_grads = jax.jit(jax.value_and_grad(
        lambda x, w: objective(cap_fn, x, w), argnums=(0, 1), has_aux=True))(x, weights)
    keep = np.asarray(keep)
    if capacity_factor < 1:
        assert not keep.all()
    else:
        assert keep.all()
    mask = jnp.asarray(keep, jnp.float32)[..., None]

    def dense_masked(x, w):
        out, _ = dense_dispatch(x, indices, w)
        return out * mask, keep

    dense_grads = jax.jit(jax.grad(lambda x, w: objective(dense_masked, x, w)[0],
                                   argnums=(0, 1)))(x, weights)
    grads = {"capacity": cap_grads}
    if capacity_factor > 1:
        grads["dropless"] = jax.jit(jax.grad(lambda x, w: objective(
            lambda x, w: dropless_dispatch(x, indices, w), x, w)[0], argnums=(0, 1)))(x, weights)
    for mode, g in grads.items():
        for name, a, b in zip(["x", "w_gate", "w_up", "w_down"], jax.tree.leaves(g),
                              jax.tree.leaves(dense_grads)):
            assert np.abs(np.asarray(b)).max() > 0, name
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                       atol=1e-5 * np.abs(np.asarray(b)).max(),
                                       err_msg=f"{mode} {name}")


def check_drops(indices_np, capacity_factor, expected_keep, rng):
    t, k = indices_np.shape
    x = jnp.asarray(rng.normal(size=(t, D)).astype(np.float32))
    weights = random_weights(rng)
    out, keep = capacity_dispatch(x, jnp.asarray(indices_np), weights, capacity_factor)
    np.testing.assert_array_equal(np.asarray(keep), expected_keep)
    oracle = np_expert_outputs(x, indices_np, weights)
    out = np.asarray(out)
    # Dropped assignments give exactly zero; kept ones the expert's real output.
    np.testing.assert_array_equal(out[~expected_keep], 0.0)
    np.testing.assert_allclose(out[expected_keep], oracle[expected_keep], rtol=1e-5, atol=1e-5)
    assert np.all(np.abs(oracle[expected_keep]).max(axis=-1) > 0)


def test_capacity_drops_when_every_token_picks_expert_zero_first(rng):
    # 6 tokens, top-2 of 4 experts, capacity_factor 0.5: C = ceil(0.5 * 6 * 2 / 4) = 2.
    indices = np.array([[0, 1], [0, 2], [0, 1], [0, 1], [0, 3], [0, 1]], np.int32)
    assert expert_capacity(6, 2, N, 0.5) == 2
    # First choices first, earlier tokens first: expert 0 keeps tokens 0 and 1 only. Second
    # choices: expert 1 is asked by tokens 0, 2, 3, 5 and keeps 0 and 2; experts 2 and 3 have
    # one request each (tokens 1 and 4) and keep it.
    expected = np.array([[True, True], [True, True], [False, True], [False, False],
                         [False, True], [False, False]])
    assert (~expected).sum() == 6                           # 6 of the 12 assignments dropped
    check_drops(indices, 0.5, expected, rng)
    slot, keep = capacity_slots(jnp.asarray(indices), N, 2)
    position = np.asarray(slot) - indices * 2
    np.testing.assert_array_equal(position[:, 0], [0, 1, 2, 3, 4, 5])      # expert 0's queue
    np.testing.assert_array_equal(position[[0, 2, 3, 5], 1], [0, 1, 2, 3])  # expert 1's queue
    np.testing.assert_array_equal(np.asarray(keep), expected)


def test_capacity_priority_is_rank_major(rng):
    # C = ceil(0.5 * 4 * 2 / 4) = 1 slot per expert. Token 0's *second* choice (expert 1) and
    # token 2's *first* choice (expert 1) compete: rank-major priority gives the slot to token 2
    # although token 0 comes first (token-major order would do the opposite).
    indices = np.array([[0, 1], [0, 2], [1, 0], [2, 3]], np.int32)
    expected = np.array([[True, False], [False, False], [True, False], [True, True]])
    check_drops(indices, 0.5, expected, rng)


@pytest.mark.parametrize("kind", ["sum", "dag"])
def test_moe_block_dispatch_modes_identical_without_drops(kind):
    x = jax.random.normal(jax.random.key(1), (2, 16, 32), jnp.float32)
    outs, stats = {}, {}
    for mode in ("capacity", "dropless", "einsum"):   # einsum: dropless, every expert everywhere
        cfg = tiny_config("moe", kind, init_std=0.2,   # O(1) expert outputs
                          experts=dict(dispatch="capacity" if mode == "capacity" else "dropless",
                                       capacity_factor=4.0))
        execution = tiny_execution(cfg, **({"grouped_matmul": "einsum"} if mode == "einsum"
                                           else {}))
        block = MoEBlock(cfg, execution, rngs=nnx.Rngs(0))        # same seed: same parameters
        if kind == "dag":   # random W_up so the DAG's pairwise terms take part
            it = block.aggregator.iterations
            it.w_up[...] = 0.2 * jax.random.normal(jax.random.key(2), it.w_up.shape)
        outs[mode], stats[mode] = nnx.jit(lambda b, v: b(BlockInputs(v)))(block, x)
    scale = float(jnp.abs(outs["capacity"]).max())
    assert scale > 0.1
    for mode in ("dropless", "einsum"):
        # The three paths sum the same products in different orders (einsum, ragged_dot, vmap);
        # the DAG's nonlinear iterations can turn that into a few 1e-6 of the output's scale.
        np.testing.assert_allclose(np.asarray(outs[mode]), np.asarray(outs["capacity"]),
                                   rtol=1e-5, atol=1e-5 * scale, err_msg=mode)
        for name in ("balance_loss", "z_loss", "expert_load"):
            np.testing.assert_allclose(np.asarray(getattr(stats[mode], name)),
                                       np.asarray(getattr(stats["capacity"], name)), rtol=1e-6)
    for mode in outs:
        assert float(stats[mode].dropped_fraction) == 0.0, mode
        assert outs[mode].shape == x.shape


def np_rank_major_keep(indices, n, capacity):
    """Independent oracle of the capacity rule: walk ranks, then tokens, counting per expert."""
    t, k = indices.shape
    used = np.zeros(n, int)
    keep = np.zeros((t, k), bool)
    for r in range(k):
        for ti in range(t):
            e = indices[ti, r]
            keep[ti, r] = used[e] < capacity
            used[e] += 1
    return keep


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_moe_block_dropped_fraction(capacity_factor):
    cfg = tiny_config("moe", "sum", init_std=0.2,
                      experts=dict(dispatch="capacity", capacity_factor=capacity_factor))
    block = MoEBlock(cfg, tiny_execution(cfg), rngs=nnx.Rngs(0))
    # Inputs with a positive mean and a raised first router column push most tokens onto
    # expert 0, so that capacity really binds.
    block.router.w_router[...] = block.router.w_router[...].at[:, 0].add(0.3)
    x = jax.random.normal(jax.random.key(3), (2, 16, 32), jnp.float32) + 1.0
    y, stats = block(BlockInputs(x))
    routing = block.router(x.reshape(-1, 32))
    indices = np.asarray(routing.indices)
    cap = expert_capacity(32, 2, N, capacity_factor)
    keep = np_rank_major_keep(indices, N, cap)
    expected = 1.0 - keep.mean()
    assert expected > 0                                       # this batch does drop
    np.testing.assert_allclose(float(stats.dropped_fraction), expected, rtol=1e-6)
    # Dropped assignments contribute nothing: the block equals the sum over kept experts only.
    experts = block.experts
    out = np_expert_outputs(x.reshape(-1, 32), indices,
                            (experts.w_gate[...], experts.w_up[...], experts.w_down[...]))
    gates = np.asarray(routing.gates, np.float64)
    expected_y = np.einsum("tk,tkd->td", gates * keep, out)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 32), expected_y, rtol=1e-4, atol=1e-6)


def test_experts_module_shapes_and_dtype():
    experts = Experts(ExpertConfig(num_experts=N, expert_hidden=H), D, std=0.02,
                      dtype=jnp.float32, execution=ExecutionConfig(grouped_matmul="einsum"),
                      rngs=nnx.Rngs(0))
    assert experts.w_gate.shape == (N, D, H)
    assert experts.w_up.shape == (N, D, H)
    assert experts.w_down.shape == (N, H, D)
    x = jax.random.normal(jax.random.key(0), (5, D))
    idx = jnp.asarray([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], jnp.int32)
    out, keep = experts(x, idx)
    assert out.shape == (5, 2, D) and keep.shape == (5, 2) and out.dtype == jnp.float32
    oracle = np_expert_outputs(x, np.asarray(idx),
                               (experts.w_gate[...], experts.w_up[...], experts.w_down[...]))
    np.testing.assert_allclose(np.asarray(out), oracle, rtol=1e-4, atol=1e-7)
