"""Upcycling DUME into DAG-MoE that trains: the fan-in initialised aggregator, aggregator-only
training (DUME+'s analogue) and its parameter-matched shared-expert baseline."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import tiny_config
from test_upcycle import N, dense_models, merge, merged_config, tokens
from dagmoe_jax.families.moe.budget import matched_shared_hidden
from dagmoe_jax.run.optim import TRAINABLE, check_trainable
from dagmoe_jax.train.step import make_train_step
from dagmoe_jax.upcycle import dume, moerge


def cycles(seed, rows=4, length=17):
    """Rows of a fixed cycle through the vocabulary from random starts (learnable)."""
    starts = np.random.default_rng(seed).integers(0, 64, (rows, 1))
    return (starts + 5 * np.arange(length)[None, :]) % 64


def batch(seed):
    toks = cycles(seed)
    return {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:])}


def loss(model, b):
    logits = model(b["inputs"])[0]
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean())


def train(model, trainable, steps=25, lr=1e-2):
    before = moerge.flat_params(model)
    wrt = TRAINABLE[trainable]
    opt = nnx.Optimizer(model, optax.adam(lr), wrt=wrt)
    step = make_train_step(wrt=wrt)
    for i in range(steps):
        step(model, opt, batch(i))
    after = moerge.flat_params(model)
    return {p for p, v in before.items() if not np.array_equal(v, after[p])}


def dume_k2():
    moe = merge(dense_models(), merged_config(2))
    stats = [dume.collect_statistics(moe, [{"inputs": np.asarray(tokens(40 + j))}], j)
             for j in range(N)]
    return dume.dume(moe, stats)


def test_fan_in_dag_and_shared_expert_start_equal_to_dume_and_their_messages_are_not_tiny():
    moe = dume_k2()
    toks = tokens(3)
    want = np.asarray(moe(toks)[0])
    moved = {}
    for fan_in in (False, True):
        dag = dume.upcycle_to_dag(moe, dag_dim=16, dag_iters=2, fan_in=fan_in)
        np.testing.assert_allclose(np.asarray(dag(toks)[0]), want, rtol=1e-5, atol=1e-5)
        w_up = dag.layers.block.aggregator.iterations.w_up
        w_up[...] = jnp.full(w_up.shape, 0.01)            # the same W_up step for both
        moved[fan_in] = np.sqrt(np.mean((np.asarray(dag(toks)[0]) - want) ** 2))
        shared = dume.add_shared_expert(moe, 24, fan_in=fan_in)
        np.testing.assert_allclose(np.asarray(shared(toks)[0]), want, rtol=1e-5, atol=1e-5)
    assert moved[True] > 30 * moved[False], moved        # messages ~1 instead of ~1e-3


@pytest.mark.parametrize("kind", ["dag", "shared"])
def test_aggregator_only_training_moves_only_it_and_lowers_the_heldout_loss(kind):
    moe = dume_k2()
    cfg = moe.cfg
    if kind == "dag":
        model, trainable = dume.upcycle_to_dag(moe, dag_dim=16, dag_iters=2, fan_in=True), \
            "aggregator"
    else:
        hidden = matched_shared_hidden(cfg.d_model, 16, 2)
        model, trainable = dume.add_shared_expert(moe, hidden, fan_in=True), "shared"
    heldout = batch(1000)
    start = loss(model, heldout)
    assert start == pytest.approx(loss(moe, heldout), abs=1e-5)          # starts as DUME
    moved = train(model, trainable)
    part = "aggregator" if kind == "dag" else "shared"
    assert moved and all(part in p for p in moved), sorted(moved)
    assert loss(model, heldout) < start - 0.05, (loss(model, heldout), start)


def test_aggregator_and_shared_sets_need_those_modules():
    with pytest.raises(ValueError, match="aggregator"):
        check_trainable(merged_config(2), "aggregator")
    with pytest.raises(ValueError, match="num_shared"):
        check_trainable(merged_config(2), "shared")
    with pytest.raises(ValueError, match="aggregator"):
        check_trainable(tiny_config("dense"), "aggregator")
