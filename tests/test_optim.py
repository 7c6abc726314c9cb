"""The optimizer: schedules, the weight-decay mask on a real model, decay and clipping, and
config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dagmoe_jax.run.config import OptimConfig
from dagmoe_jax.run.optim import (decay_mask, fitted_warmup, make_optimizer,
                                  make_schedule, schedule_note)
from conftest import make_model


def lr_at(schedule, *steps):
    return [float(schedule(jnp.asarray(t))) for t in steps]


# ----------------------------------------------------------------------------- schedules

def test_wsd_schedule_key_steps():
    cfg = OptimConfig(learning_rate=1e-3, schedule="wsd", warmup_steps=100, decay_fraction=0.2,
                      min_lr_ratio=0.1)
    s = make_schedule(cfg, 1000)            # warm-up 0..100, stable 100..800, decay 800..1000
    start, half_warm, warm_end, stable, decay_start, half_decay, end, after = lr_at(
        s, 0, 50, 100, 400, 800, 900, 1000, 5000)
    assert start == 0.0
    np.testing.assert_allclose([half_warm, warm_end, stable, decay_start],
                               [5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6)
    assert lr_at(s, 799) == pytest.approx([1e-3], rel=1e-6)
    np.testing.assert_allclose([half_decay, end, after], [5.5e-4, 1e-4, 1e-4], rtol=1e-5)
    assert lr_at(s, 801)[0] < 1e-3


def test_wsd_without_decay_or_warmup():
    s = make_schedule(OptimConfig(learning_rate=2e-3, warmup_steps=0, decay_fraction=0.0), 10)
    np.testing.assert_allclose(lr_at(s, 0, 5, 10, 20), [2e-3] * 4, rtol=1e-6)
    # warm-up and decay may fill the whole run (no stable phase)
    s = make_schedule(OptimConfig(learning_rate=1.0, warmup_steps=5, decay_fraction=0.5), 10)
    np.testing.assert_allclose(lr_at(s, 0, 5, 10), [0.0, 1.0, 0.0], atol=1e-6)


def test_cosine_schedule_key_steps():
    cfg = OptimConfig(learning_rate=1e-3, schedule="cosine", warmup_steps=100, min_lr_ratio=0.1)
    s = make_schedule(cfg, 1100)            # cosine over 100..1100, midpoint 600
    start, warm_end, mid, end, after = lr_at(s, 0, 100, 600, 1100, 3000)
    assert start == 0.0
    np.testing.assert_allclose([warm_end, mid, end, after], [1e-3, 5.5e-4, 1e-4, 1e-4], rtol=1e-5)


def test_constant_schedule_key_steps():
    s = make_schedule(OptimConfig(learning_rate=1e-3, schedule="constant", warmup_steps=10), 100)
    np.testing.assert_allclose(lr_at(s, 0, 5, 10, 50, 100, 1000),
                               [0.0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3], rtol=1e-6)


def test_a_run_shorter_than_its_warmup_warms_up_over_a_tenth_of_it():
    """The paper's 2,000 warm-up steps in a 40-step run: a 4-step warm-up, then the WSD
    plateau and the decay over the last 20% (8 steps), as a config written for 40 steps;
    schedule_note says so. A warm-up that fits is left alone (no note)."""
    paper = OptimConfig(learning_rate=1e-3, warmup_steps=2000, decay_fraction=0.2)
    assert fitted_warmup(paper, 40) == 4
    fitted = OptimConfig(learning_rate=1e-3, warmup_steps=4, decay_fraction=0.2)
    steps = list(range(45))
    np.testing.assert_allclose(lr_at(make_schedule(paper, 40), *steps),
                               lr_at(make_schedule(fitted, 40), *steps), rtol=1e-6)
    note = schedule_note(paper, 40)
    assert "warmup_steps=2000" in note and "over 4 steps" in note and "\n" not in note
    assert schedule_note(fitted, 40) == "" and fitted_warmup(fitted, 40) == 4
    # cosine: a warm-up as long as the run; constant: longer than the run
    assert fitted_warmup(OptimConfig(schedule="cosine", warmup_steps=100), 100) == 10
    assert fitted_warmup(OptimConfig(schedule="constant", warmup_steps=101), 100) == 10
    assert fitted_warmup(OptimConfig(schedule="constant", warmup_steps=100), 100) == 100
    # 6 steps: no warm-up at all (a tenth of 6 is 0): the first update is at the peak, and
    # the note says so rather than "warming up over 0 steps"
    assert lr_at(make_schedule(paper, 6), 0)[0] == pytest.approx(1e-3)
    note = schedule_note(paper, 3)
    assert "3-step run: no warm-up instead" in note and "over 0 steps" not in note, note


def test_schedule_steps_that_do_not_fit():
    with pytest.raises(ValueError, match=r"exceed total_steps=100: bind "
                                         r"--gin.OptimConfig.decay_fraction=") as err:
        make_schedule(OptimConfig(warmup_steps=90, decay_fraction=0.95), 100)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="total_steps=0 is invalid"):
        make_schedule(OptimConfig(), 0)


# ----------------------------------------------------------------------------- mask on a model

NO_DECAY = {
    "final_norm/scale",
    "layers/attn_norm/scale",
    "layers/block_norm/scale",
    "layers/block/aggregator/iterations/ln_scale",
    "layers/block/aggregator/iterations/ln_bias",
}


def leaf_paths(tree):
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        names = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
        if names[-1] == "value":
            names = names[:-1]
        out["/".join(map(str, names))] = leaf
    return out


def test_decay_mask_excludes_exactly_norms_and_biases(tiny):
    model = make_model(tiny(block="moe", kind="dag", experts=dict(num_shared=1)))
    params = nnx.state(model, nnx.Param)
    mask = leaf_paths(decay_mask(params))
    assert set(mask) == set(leaf_paths(params))
    assert {p for p, m in mask.items() if not m} == NO_DECAY
    # the shared expert and the DAG matrices are decayed
    for p in ("layers/block/shared/w_up", "layers/block/aggregator/iterations/w_edge",
              "layers/block/experts/w_gate", "embed", "lm_head"):
        assert mask[p] is True
    # the pure-array form gives the same answer
    assert leaf_paths(decay_mask(nnx.to_pure_dict(params))) == mask


def test_weight_decay_skips_norms_with_zero_grads(tiny):
    """One update with zero gradients: Adam's step is 0, so only decoupled decay moves params."""
    model = make_model(tiny(block="moe", kind="dag", experts=dict(num_shared=1)))
    lr, wd = 0.1, 0.1
    tx = make_optimizer(OptimConfig(learning_rate=lr, schedule="constant", warmup_steps=0,
                                    weight_decay=wd), total_steps=10)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = leaf_paths(jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
    zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    optimizer.update(model, zeros)
    after = leaf_paths(nnx.state(model, nnx.Param))
    for path, old in before.items():
        new = np.asarray(after[path])
        if path in NO_DECAY:
            np.testing.assert_array_equal(new, old, err_msg=path)
        else:
            np.testing.assert_allclose(new, (1 - lr * wd) * old, rtol=1e-6, atol=1e-12,
                                       err_msg=path)
            assert np.abs(old).max() == 0 or np.abs(new).sum() < np.abs(old).sum(), path


# ----------------------------------------------------------------------------- clipping

def test_clipping_bounds_the_update():
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
    grads = {"w": jnp.full((4, 4), 300.0), "b": jnp.full((4,), -400.0)}
    norm = float(jnp.sqrt(16 * 300.0 ** 2 + 4 * 400.0 ** 2))
    # eps = 1 makes Adam's step depend on the gradient's scale, so clipping is visible in it.
    base = dict(learning_rate=0.1, schedule="constant", warmup_steps=0, weight_decay=0.0, eps=1.0)

    def first_update(cfg, g):
        tx = make_optimizer(cfg, total_steps=10)
        updates, _ = tx.update(g, tx.init(params), params)
        return updates

    clipped = first_update(OptimConfig(grad_clip=1.0, **base), grads)
    by_hand = first_update(OptimConfig(grad_clip=0.0, **base),
                           jax.tree.map(lambda g: g / norm, grads))
    unclipped = first_update(OptimConfig(grad_clip=0.0, **base), grads)
    for k in params:
        np.testing.assert_allclose(clipped[k], by_hand[k], rtol=1e-5)
    # Adam's bias-corrected first step is lr * g / (|g| + eps), so its norm is <= lr * |g| = lr
    assert float(optax.tree.norm(clipped)) <= 0.1 * 1.0 + 1e-6
    assert float(optax.tree.norm(unclipped)) > 3 * float(optax.tree.norm(clipped))


# ----------------------------------------------------------------------------- config errors

@pytest.mark.parametrize("field, value, expected", [
    ("learning_rate", -1e-3, "a number > 0"),
    ("learning_rate", 0.0, "a number > 0"),
    ("schedule", "linear", "one of 'wsd', 'cosine', 'constant'"),
    ("warmup_steps", -1, "an integer >= 0"),
    ("warmup_steps", 1.5, "an integer >= 0"),
    ("decay_fraction", 1.5, r"a number in \[0, 1\]"),
    ("decay_fraction", -0.1, r"a number in \[0, 1\]"),
    ("min_lr_ratio", 2.0, r"a number in \[0, 1\]"),
    ("weight_decay", -0.1, "a number >= 0"),
    ("b1", 1.0, r"a number in \[0, 1\)"),
    ("b2", 1.0, r"a number in \(0, 1\)"),
    ("b2", 0.0, r"a number in \(0, 1\)"),
    ("eps", 0.0, "a number > 0"),
    ("grad_clip", -1.0, "a number >= 0"),
])
def test_config_errors(field, value, expected):
    with pytest.raises(ValueError, match=rf"OptimConfig\.{field}={value!r} is invalid: expected "
                                         rf"{expected}") as err:
        OptimConfig(**{field: value})
    assert "\n" not in str(err.value)


def test_defaults_are_valid():
    cfg = OptimConfig()
    assert (cfg.learning_rate, cfg.schedule, cfg.warmup_steps, cfg.decay_fraction) == (
        3e-3, "wsd", 100, 0.2)
    assert (cfg.b1, cfg.b2, cfg.grad_clip, cfg.weight_decay) == (0.9, 0.95, 1.0, 0.1)
    make_optimizer(cfg, 1000)


def test_optimizer_state_structure_does_not_depend_on_hyperparameters():
    """A run resumed with another clip / schedule / lr must find the same state tree."""
    params = {"w": jnp.ones((3, 2)), "norm": {"scale": jnp.ones((2,))}}
    structures = {jax.tree_util.tree_structure(make_optimizer(cfg, 1000).init(params))
                  for cfg in (OptimConfig(), OptimConfig(grad_clip=0.0),
                              OptimConfig(schedule="cosine", learning_rate=1.0))}
    assert len(structures) == 1


@pytest.mark.parametrize("block,trainable,refused", [
    ("dense", "router", "dense model: it has no router"),
    ("doe", "router", "DoE model: it has no router"),
    ("doe", "non_experts", "DoE model: it has no routed experts"),
    ("dense", "router_and_gates", "dense model: it has no routed experts"),
    ("coe", "aggregator", "needs a DAG or MLP aggregator"),
    ("moe", "shared", "needs shared experts"),
    ("coe", "router", None), ("moe", "non_experts", None), ("dense", "all", None)])
def test_a_trainable_subset_the_family_lacks_is_refused_in_one_line(block, trainable, refused):
    """check_trainable asks the family's config (its router, routed experts, aggregation), not
    its name: a subset that would leave nothing to learn is one line naming the family."""
    from dagmoe_jax.run.optim import check_trainable
    from conftest import tiny_config
    cfg = tiny_config(block)
    if refused is None:
        check_trainable(cfg, trainable)
    else:
        with pytest.raises(ValueError, match=refused):
            check_trainable(cfg, trainable)


def test_shared_experts_train_alone_in_any_family_that_has_them():
    """'shared' needs shared experts, whichever routed family holds them: a CoE with one is
    accepted, and the subset selects exactly its shared experts' weights."""
    from dagmoe_jax.run.optim import TRAINABLE, check_trainable
    from conftest import tiny_config
    cfg = tiny_config("coe", experts={"num_shared": 1, "shared_hidden": 16})
    check_trainable(cfg, "shared")
    model = make_model(cfg)
    paths = [p for p, _ in nnx.to_flat_state(nnx.state(model, TRAINABLE["shared"]))]
    assert paths and all("shared" in p for p in paths)
