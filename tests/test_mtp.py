"""Multi-token prediction (DeepSeek-V3 sec. 2.2; ``ModelConfig.mtp``, dagmoe_jax/model/mtp.py):
eq. 21's combination and eq. 24-25's loss against NumPy transcriptions, the shifted targets
and masks worked by hand, causality, dropped at inference, every parameter trained, the
modules' selection biases moved, parameters counted, and the configs that cannot have it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.config import ModelConfig, MTPConfig
from dagmoe_jax.model.accounting import account
from dagmoe_jax.model.layers import RMSNorm
from dagmoe_jax.model.mtp import depth_targets, mtp_input
from dagmoe_jax.train.step import lm_loss, make_train_step


def np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def test_the_combination_is_eq_21(rng):
    """h' = M_k [RMSNorm(h^{k-1}); RMSNorm(Emb(t_{i+k}))], M_k's rows the embedding's first."""
    d = 8
    h, e = rng.standard_normal((2, 5, d)), rng.standard_normal((2, 5, d))
    w = rng.standard_normal((2 * d, d))
    enorm, hnorm = RMSNorm(d, 1e-6, rngs=nnx.Rngs(0)), RMSNorm(d, 1e-6, rngs=nnx.Rngs(0))
    se, sh = rng.uniform(0.5, 1.5, d), rng.uniform(0.5, 1.5, d)
    enorm.scale[...], hnorm.scale[...] = jnp.asarray(se), jnp.asarray(sh)
    got = mtp_input(jnp.asarray(h, jnp.float32), jnp.asarray(e, jnp.float32), enorm, hnorm,
                    jnp.asarray(w, jnp.float32))
    want = np_rms(e, se, 1e-6) @ w[:d] + np_rms(h, sh, 1e-6) @ w[d:]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_each_depth_predicts_the_token_k_ahead_within_its_example():
    """Position i at depth k predicts targets[i + k]; the last k positions, untrained targets
    and targets in another packed example are not counted."""
    targets = jnp.asarray([[11, 12, 13, 14, 15, 16]])
    mask = jnp.asarray([[1, 1, 1, 1, 0, 1]], bool)
    segments = jnp.asarray([[1, 1, 1, 2, 2, 2]])
    got, trained = depth_targets(targets, mask, None, 1)
    assert got.tolist() == [[12, 13, 14, 15, 16, 0]]
    assert trained.tolist() == [[True, True, True, False, True, False]]
    got, trained = depth_targets(targets, mask, segments, 2)
    assert got.tolist() == [[13, 14, 15, 16, 0, 0]]
    # i=0 -> 13 (example 1), i=1 -> 14 (example 2), i=2 -> 15 (2), i=3 -> 16 (2, trained)
    assert trained.tolist() == [[True, False, False, True, False, False]]


def mtp_model(block="moe", depth=2, **changes):
    cfg = tiny_config(block, "sum", **changes).replace(mtp=MTPConfig(depth=depth,
                                                                     loss_weight=0.4))
    return make_model(cfg, seed=1), cfg


def batch_of(cfg: ModelConfig, seed=0, rows=2, length=12):
    t = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (rows, length + 1)),
                    jnp.int32)
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def test_the_loss_is_eq_24_25_with_the_shared_head():
    """loss = the main loss + lambda / D sum_k (CE_k + the depth's router losses), CE_k the
    softmax cross-entropy of the shared head's logits of depth k's normed states against the
    tokens k + 1 ahead, written out in NumPy."""
    model, cfg = mtp_model()
    batch = batch_of(cfg)
    total, metrics = lm_loss(model, batch)
    h, aux = model(batch["inputs"], head=False)
    normed, mtp_aux = model.predict_further(h, batch["targets"])
    head = np.asarray(model.lm_head[...])
    targets = np.asarray(batch["targets"])
    ces = []
    for k in range(1, cfg.mtp.depth + 1):
        logits = np.asarray(normed[k - 1], np.float64) @ head
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
            -1, keepdims=True)) - logits.max(-1, keepdims=True)
        picked = np.take_along_axis(logp[:, :-k], targets[:, k:, None], -1)[..., 0]
        ces.append(-picked.mean())
    main = float(metrics["ce_loss"]) + float(aux["aux_loss"])
    want = main + 0.4 * (np.mean(ces) + float(mtp_aux["aux_loss"]))
    assert float(metrics["mtp_loss"]) == pytest.approx(np.mean(ces), rel=1e-5)
    assert float(total) == pytest.approx(want, rel=1e-5)
    assert float(mtp_aux["aux_loss"]) > 0


def test_a_depth_sees_no_token_past_the_one_it_embeds():
    """Depth k at position i reads tokens up to t_{i+k} (targets[i + k - 1]): changing
    targets[j] leaves depth k's states before position j - k + 1 as they were."""
    model, cfg = mtp_model("dense")
    batch = batch_of(cfg)
    h, _ = model(batch["inputs"], head=False)
    before, _ = model.predict_further(h, batch["targets"])
    j = 8
    changed = batch["targets"].at[:, j].set((batch["targets"][:, j] + 1) % cfg.vocab_size)
    after, _ = model.predict_further(h, changed)
    for k in (1, 2):
        np.testing.assert_array_equal(np.asarray(before[k - 1, :, :j - k + 1]),
                                      np.asarray(after[k - 1, :, :j - k + 1]))
        assert not np.allclose(np.asarray(before[k - 1, :, j - k + 1]),
                               np.asarray(after[k - 1, :, j - k + 1]))


def test_the_modules_are_dropped_at_inference():
    """The logits never read the modules: perturbing every one of their parameters changes
    nothing the model outputs."""
    model, cfg = mtp_model("coe", coe=dict(iterations=2))
    tokens = batch_of(cfg)["inputs"]
    before = np.asarray(model(tokens)[0])
    for _, variable in nnx.to_flat_state(nnx.state(model.mtp, nnx.Param)):
        variable.set_value(variable[...] + 1.0)
    np.testing.assert_array_equal(np.asarray(model(tokens)[0]), before)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_every_module_parameter_learns_and_its_biases_move(grad_accum):
    """One step trains every parameter of the modules (gradient reaches M_k, both norms, the
    layer and the final norm) and moves their routers' selection biases with the layers'."""
    model, cfg = mtp_model(router=dict(aux_free_bias_rate=0.01), depth=1)
    old = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model.mtp,
                                                                          nnx.Param))}
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = make_train_step(grad_accum=grad_accum)(model, optimizer, batch_of(cfg, rows=4))
    assert np.isfinite(float(metrics["mtp_loss"]))
    new = dict(nnx.to_flat_state(nnx.state(model.mtp, nnx.Param)))
    still = [k for k, v in old.items() if np.array_equal(v, np.asarray(new[k][...]))]
    assert not still, still
    for stack in (model.layers, model.mtp.layer):
        assert np.abs(np.asarray(stack.block.router.selection_bias[...])).max() == \
            pytest.approx(0.01)


@pytest.mark.parametrize("block", ["dense", "moe", "coe"])
def test_the_modules_are_counted(block):
    model, cfg = mtp_model(block, depth=2)
    built = sum(int(np.prod(v[...].shape))
                for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    acc = account(cfg, 12)
    assert acc.total_params == built
    without = account(cfg.replace(mtp=MTPConfig()), 12)
    assert acc.params["mtp"] == built - without.total_params
    assert acc.train_flops_per_token > without.train_flops_per_token


@pytest.mark.parametrize("changes, needle", [
    (dict(mtp=dict(depth=-1)), "MTPConfig.depth=-1"),
    (dict(mtp=dict(loss_weight=-0.1)), "MTPConfig.loss_weight=-0.1"),
    (dict(block="doe", mtp=dict(depth=1)), "depth 0 with block='doe'"),
])
def test_what_cannot_be_is_one_line(changes, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")) as err:
        ModelConfig().replace(**changes)
    assert "\n" not in str(err.value)


def test_the_config_reads_back_and_from_gin():
    from dagmoe_jax.run.gin import load_model_config
    cfg = load_model_config(["models/tiny.gin"], ["ModelConfig.mtp = @MTPConfig()",
                                                  "MTPConfig.depth = 1",
                                                  "MTPConfig.loss_weight = 0.1"])
    assert cfg.mtp == MTPConfig(depth=1, loss_weight=0.1)
    import dataclasses
    assert ModelConfig.from_dict(dataclasses.asdict(cfg)) == cfg
    assert ModelConfig.from_dict({k: v for k, v in dataclasses.asdict(cfg).items()
                                  if k != "mtp"}).mtp == MTPConfig()
