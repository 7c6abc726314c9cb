"""Routing the field trains with (issue 50, item 3): the per-sequence balance loss, auxiliary-loss-
free balancing, and the per-expert load in the metrics.

* ``RouterConfig.balance_scope='sequence'``: DeepSeek-V2's expert-level / DeepSeek-V3's
  sequence-wise balance loss, f_i and P_i counted within each row of the batch and the loss
  averaged over rows; checked against a NumPy transcription of DeepSeek's ``MoEGate.forward``
  ``seq_aux`` branch.
* ``RouterConfig.aux_free_bias_rate``: DeepSeek-V3 eq. 16 (a per-expert bias selects, the
  unbiased scores gate) and its update ``b_i += rate * sign(mean_j c_j - c_i)`` after each
  training step; the bias is no parameter (no gradient, no optimizer state) and is saved with
  the model.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax import run as run_lib
from dagmoe_jax.config import ModelConfig, RouterConfig
from dagmoe_jax.model.routed.router import (Router, SelectionBias, aux_free_bias_update,
                                            aux_free_top_k, balance_loss, balance_probs,
                                            select_top_k, sequence_balance_loss)
from dagmoe_jax.run.optim import TRAINABLE
from dagmoe_jax.train.step import make_train_step


def np_seq_aux(scores, topk_idx, bsz, n, k):
    """DeepSeek's ``MoEGate.forward``, ``seq_aux`` branch (modeling_deepseek.py of
    deepseek-ai/DeepSeek-V2), in NumPy, without ``alpha``: ce[b, i] = expert i's count among row
    b's S * K assignments / (S * K / N); loss = mean_b sum_i ce[b, i] * mean_t scores[b, t, i]."""
    seq_len = scores.shape[0] // bsz
    idx = topk_idx.reshape(bsz, -1)
    ce = np.zeros((bsz, n))
    for b in range(bsz):
        np.add.at(ce[b], idx[b], 1.0)
    ce /= seq_len * k / n
    return (ce * scores.reshape(bsz, seq_len, n).mean(axis=1)).sum(axis=1).mean()


def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_bias_update(bias, counts, rate):
    counts = np.asarray(counts, np.float64)
    return bias + rate * np.sign(counts.mean(-1, keepdims=True) - counts)


@nnx.jit
def forward(model, tokens):
    return model(tokens)


def batch_of(cfg, rows=4, length=12, seed=0):
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (rows, length + 1))
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def biases(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, SelectionBias))}


# ---------------------------------------------------------------- per-sequence balance loss

@pytest.mark.parametrize("load", ["slots", "tokens"])
def test_sequence_balance_loss_is_deepseeks_seq_aux(load):
    rng = np.random.default_rng(0)
    bsz, seq_len, n, k = 3, 10, 6, 2
    logits = rng.normal(size=(bsz * seq_len, n)).astype(np.float32)
    scores = np_softmax(logits.astype(np.float64))
    _, idx = jax.lax.top_k(jnp.asarray(scores), k)
    want = np_seq_aux(scores, np.asarray(idx), bsz, n, k) * (k if load == "tokens" else 1)
    probs = balance_probs(jnp.asarray(logits), jnp.asarray(scores, jnp.float32), "softmax")
    got = sequence_balance_loss(probs, idx, bsz, load)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    # ... and through the router: softmax scores, the 'slots' convention, 'sequence' scope
    cfg = RouterConfig(score_fn="softmax", top_k=k, balance_load=load, balance_scope="sequence")
    router = Router(cfg, 8, n, std=0.5, rngs=nnx.Rngs(1))
    x = jnp.asarray(rng.normal(size=(bsz * seq_len, 8)), jnp.float32)
    routing = router(x)
    s = np.asarray(routing.scores, np.float64)
    want = np_seq_aux(s, np.asarray(routing.indices), bsz, n, k) * (k if load == "tokens" else 1)
    np.testing.assert_allclose(float(router.losses(routing, sequences=bsz)["balance_loss"]),
                               want, rtol=1e-5)


def test_one_sequence_is_the_batch_loss_and_rows_differ():
    rng = np.random.default_rng(1)
    for load in ("tokens", "slots"):
        probs = jnp.asarray(np_softmax(rng.normal(size=(16, 5))), jnp.float32)
        idx = jax.lax.top_k(probs, 2)[1]
        np.testing.assert_allclose(float(sequence_balance_loss(probs, idx, 1, load)),
                                   float(balance_loss(probs, idx, load)), rtol=1e-6)
    # two rows each routed to their own two experts: balanced over the batch, not per row
    probs = jnp.asarray(np.repeat(np.eye(4)[[0, 2]], 8, axis=0) * 0.5
                        + np.repeat(np.eye(4)[[1, 3]], 8, axis=0) * 0.5, jnp.float32)
    idx = jnp.asarray(np.repeat([[0, 1], [2, 3]], 8, axis=0))
    assert float(balance_loss(probs, idx, "slots")) == pytest.approx(1.0)   # balanced
    assert float(sequence_balance_loss(probs, idx, 2, "slots")) == pytest.approx(2.0)


def test_sequence_scope_in_the_model():
    """The MoE block passes its B rows as the sequences: B equal rows give the batch loss (each
    row's f and P are the batch's), different rows another; the scope changes the loss only,
    never the outputs."""
    batch = tiny_config("moe", "sum")
    seq = tiny_config("moe", "sum", router={"balance_scope": "sequence"})
    tokens = batch_of(batch)["inputs"]
    model_b, model_s = make_model(batch), make_model(seq)
    (lb, ab), (ls, as_) = forward(model_b, tokens), forward(model_s, tokens)
    np.testing.assert_array_equal(np.asarray(lb), np.asarray(ls))
    assert float(ab["balance_loss"]) != pytest.approx(float(as_["balance_loss"]), rel=1e-4)
    same = jnp.repeat(tokens[:1], tokens.shape[0], axis=0)
    _, one_b = forward(model_b, same)
    _, one_s = forward(model_s, same)
    np.testing.assert_allclose(float(one_s["balance_loss"]), float(one_b["balance_loss"]),
                               rtol=1e-6)


# ---------------------------------------------------------------- auxiliary-loss-free selection

def test_the_bias_selects_and_the_scores_gate():
    rng = np.random.default_rng(2)
    scores = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(64, 6)))), jnp.float32)
    k = 2
    plain_g, plain_i = select_top_k(scores, k, False)
    g0, i0 = select_top_k(scores, k, False, jnp.zeros(6))
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(plain_g))    # zero bias: no change
    np.testing.assert_array_equal(np.asarray(i0), np.asarray(plain_i))
    bias = jnp.asarray([0.0, 0.0, 0.0, 0.0, 0.0, 2.0])                    # expert 5 always wins
    gates, idx = aux_free_top_k(scores, bias, k)
    assert np.all(np.asarray(idx)[:, 0] == 5)
    assert not np.array_equal(np.asarray(idx), np.asarray(plain_i))      # the selection moved
    # ... but every gate is its expert's own unbiased score
    np.testing.assert_array_equal(np.asarray(gates),
                                  np.take_along_axis(np.asarray(scores), np.asarray(idx), -1))
    # NumPy: the K largest biased scores, in descending order
    want = np.argsort(-(np.asarray(scores) + np.asarray(bias)), axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(idx), want)
    g_r, _ = select_top_k(scores, k, True, bias)                          # DeepSeek-V3 renormalises
    np.testing.assert_allclose(np.asarray(g_r), np.asarray(gates) / np.asarray(gates).sum(
        -1, keepdims=True), rtol=1e-6)


def test_bias_update_rule_against_numpy():
    rng = np.random.default_rng(3)
    bias = rng.normal(size=(3, 8)).astype(np.float32)
    counts = rng.integers(0, 50, size=(3, 8))
    counts[1] = 7                                          # all at the mean: no change
    counts[2, :4], counts[2, 4:] = 10, 30                  # mean 20: no expert exactly at it
    got = aux_free_bias_update(jnp.asarray(bias), jnp.asarray(counts), 0.001)
    np.testing.assert_allclose(np.asarray(got), np_bias_update(bias, counts, 0.001), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[1], bias[1])
    # an expert exactly at a fractional-looking mean: 3 experts, counts 1, 2, 3 (mean 2)
    np.testing.assert_array_equal(np.asarray(aux_free_bias_update(
        jnp.zeros(3), jnp.asarray([1, 2, 3]), 0.5)), [0.5, 0.0, -0.5])


def test_the_sign_update_balances_a_skewed_router():
    """Fixed skewed scores (the router not learning): the bias alone moves the load towards
    balance, step by step as NumPy's transcription of the rule does."""
    rng = np.random.default_rng(4)
    n, k, rate = 8, 2, 0.02
    offset = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    scores = 1 / (1 + np.exp(-(rng.normal(size=(512, n)) + offset)))

    @jax.jit
    def step(bias):
        _, idx = aux_free_top_k(jnp.asarray(scores, jnp.float32), bias, k)
        counts = jnp.zeros((n,), jnp.int32).at[idx.reshape(-1)].add(1)
        return aux_free_bias_update(bias, counts, rate), counts

    bias, np_bias, imbalance = jnp.zeros(n), np.zeros(n), []
    for _ in range(60):
        np_idx = np.argsort(-(scores + np_bias), axis=-1, kind="stable")[:, :k]
        np_counts = np.bincount(np_idx.reshape(-1), minlength=n)
        bias, counts = step(bias)
        np.testing.assert_array_equal(np.asarray(counts), np_counts)
        np_bias = np_bias_update(np_bias, np_counts, rate)
        np.testing.assert_allclose(np.asarray(bias), np_bias, atol=1e-6)
        imbalance.append(np_counts.max() / np_counts.mean())
    assert imbalance[0] > 2.5 and imbalance[-1] < 1.3
    assert np.asarray(bias)[0] < 0 < np.asarray(bias)[-1]   # the favoured expert pushed down


# ---------------------------------------------------------------- the bias in training

AUX_FREE = {"aux_free_bias_rate": 0.01}


def test_the_bias_is_no_parameter_and_moves_after_each_step():
    cfg = tiny_config("moe", "sum", router=AUX_FREE)
    plain = make_model(tiny_config("moe", "sum"))
    model = make_model(cfg)
    paths = list(biases(model))
    assert paths == [("layers", "block", "router", "selection_bias")]
    assert biases(model)[paths[0]].shape == (2, 4) and not biases(model)[paths[0]].any()
    # the same parameters as without it (no random draw spent on the bias), outputs equal
    for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(plain, nnx.Param)),
                              nnx.to_flat_state(nnx.state(model, nnx.Param))):
        assert p == q and np.array_equal(np.asarray(a[...]), np.asarray(b[...]))
    batch = batch_of(cfg)
    (logits, aux), (plain_logits, _) = (forward(model, batch["inputs"]),
                                        forward(plain, batch["inputs"]))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain_logits))
    counts = np.asarray(aux["router_counts"])
    assert counts.shape == (2, 1, 4) and np.all(counts.sum(-1) == 4 * 12 * 2)
    # no optimizer state for it: AdamW holds exactly what it holds without the option
    tx = optax.adamw(1e-3, weight_decay=0.1)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    shapes = lambda o: [x.shape for x in jax.tree.leaves(nnx.state(o))]  # noqa: E731
    assert shapes(opt) == shapes(nnx.Optimizer(plain, tx, wrt=nnx.Param))
    assert not any("selection_bias" in str(p) for p, _ in nnx.to_flat_state(nnx.state(opt)))
    make_train_step()(model, opt, batch)
    np.testing.assert_allclose(biases(model)[paths[0]],
                               np_bias_update(np.zeros((2, 4)), counts[:, 0], 0.01), atol=1e-7)


def test_accumulated_steps_count_the_whole_batch():
    cfg = tiny_config("moe", "sum", router=AUX_FREE)
    batch = batch_of(cfg)
    after = {}
    for accum in (1, 2):
        model = make_model(cfg)
        opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
        make_train_step(grad_accum=accum)(model, opt, batch)
        after[accum] = biases(model)
    # the micro-batches' counts summed are the batch's: the same update
    for path in after[1]:
        np.testing.assert_array_equal(after[1][path], after[2][path])
        assert after[1][path].any()


def test_frozen_routers_keep_their_bias():
    cfg = tiny_config("moe", "sum", router=AUX_FREE, experts={"num_shared": 1})
    batch = batch_of(cfg)
    frozen = make_model(cfg)
    wrt = TRAINABLE["shared"]
    opt = nnx.Optimizer(frozen, optax.sgd(1e-3), wrt=wrt)
    make_train_step(wrt=wrt)(frozen, opt, batch)
    assert not any(v.any() for v in biases(frozen).values())


def test_coe_moves_each_router_by_its_own_assignments():
    cfg = tiny_config("coe", coe={"shared_router": False}, router=AUX_FREE)
    model = make_model(cfg)
    batch = batch_of(cfg)
    counts = np.asarray(forward(model, batch["inputs"])[1]["router_counts"])
    assert counts.shape == (2, 2, 4)                          # layers, routers, experts
    opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    make_train_step()(model, opt, batch)
    got = biases(model)
    for r in range(2):
        np.testing.assert_allclose(got[("layers", "block", "routers", r, "selection_bias")],
                                   np_bias_update(np.zeros((2, 4)), counts[:, r], 0.01),
                                   atol=1e-7)


def test_the_bias_is_saved_and_restored_with_the_model(tmp_path):
    cfg = tiny_config("moe", "sum", router=AUX_FREE)
    model = make_model(cfg)
    opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    for seed in range(3):
        make_train_step()(model, opt, batch_of(cfg, seed=seed))
    saved = biases(model)
    assert any(v.any() for v in saved.values())
    meta = run_lib.model_meta(cfg)
    with run_lib.Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        ckpt.save(3, run_lib.train_state(model, opt), meta=meta, force=True)
    fresh = make_model(cfg, seed=5)
    fresh_opt = nnx.Optimizer(fresh, optax.sgd(1e-3), wrt=nnx.Param)
    abstract = run_lib.abstract(run_lib.train_state(fresh, fresh_opt))
    with run_lib.Checkpointer(tmp_path, save_every=1) as ckpt:
        restored = ckpt.restore(abstract, expected_meta=meta)
    nnx.update(fresh, restored.state["model"])
    for path, value in saved.items():
        np.testing.assert_array_equal(biases(fresh)[path], value)


def test_a_checkpoint_without_biases_restores_them_at_zero(tmp_path):
    """A step written without auxiliary-loss-free balancing (before it existed, or with it off)
    restores into a model with it: every array it holds, the biases left at their zeros. The
    other way round, a step's biases have no place in a model without them: a mismatch."""
    plain_cfg = tiny_config("moe", "sum")
    plain = make_model(plain_cfg, seed=3)
    opt = nnx.Optimizer(plain, optax.sgd(1e-3), wrt=nnx.Param)
    with run_lib.Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        ckpt.save(1, run_lib.train_state(plain, opt), meta=run_lib.model_meta(plain_cfg),
                  force=True)
    model = make_model(tiny_config("moe", "sum", router=AUX_FREE))
    model_opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    with run_lib.Checkpointer(tmp_path, save_every=1) as ckpt:
        restored = ckpt.restore(run_lib.abstract(run_lib.train_state(model, model_opt)))
    nnx.update(model, restored.state["model"])
    assert not any(v.any() for v in biases(model).values())
    for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(plain, nnx.Param)),
                              nnx.to_flat_state(nnx.state(model, nnx.Param))):
        assert p == q and np.array_equal(np.asarray(a[...]), np.asarray(b[...]))
    with run_lib.Checkpointer(tmp_path / "biased", save_every=1, async_save=False) as ckpt:
        ckpt.save(1, run_lib.train_state(model, model_opt), meta={}, force=True)
        with pytest.raises(ValueError, match="selection_bias .* is there but not in this"):
            ckpt.restore(run_lib.abstract(run_lib.train_state(plain, opt)))


def test_new_router_fields_absent_from_an_old_checkpoint_are_no_change():
    cfg = ModelConfig()
    old = json.loads(json.dumps(run_lib.model_meta(cfg)))
    for field in ("balance_scope", "aux_free_bias_rate"):
        del old["model_config"]["block"]["router"][field]
    assert run_lib.resume_changes("/nonexistent", cfg, None, old) == ([], [])
    on = cfg.replace(block=dict(router=dict(aux_free_bias_rate=0.001)))
    assert run_lib.resume_changes("/nonexistent", on, None, old)[0] == [
        "ModelConfig.block.router.aux_free_bias_rate (absent) -> 0.001"]


@pytest.mark.parametrize("field, value", [("balance_scope", "row"),
                                          ("aux_free_bias_rate", -0.1)])
def test_config_errors(field, value):
    with pytest.raises(ValueError, match=f"RouterConfig.{field}"):
        RouterConfig(**{field: value})
    assert dataclasses.asdict(RouterConfig())["balance_scope"] == "batch"


# ---------------------------------------------------------------- per-expert load in the metrics

def test_metrics_jsonl_has_the_load_per_expert_and_its_imbalance(tmp_path):
    from dagmoe_jax.run.records import read_metrics
    from dagmoe_jax.train.metrics import MetricsWriter

    load = np.array([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]])
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(1, {"loss": 2.0, "expert_load": load, "dropped_fraction": np.zeros(2)})
    writer.write(1, {"expert_load": np.zeros((2, 0))})                 # a dense model
    writer.close()
    routed, dense = read_metrics(tmp_path)
    assert routed["expert_load"] == load.tolist()
    np.testing.assert_allclose(routed["load_imbalance"], [2.0, 1.0])
    assert "load_imbalance" not in dense


def test_the_load_balance_plot_reads_the_training_records(tmp_path):
    from dagmoe_jax.analysis import plots
    from dagmoe_jax.analysis.report import load_series

    rng = np.random.default_rng(5)
    loads = rng.dirichlet(np.ones(4), size=(3, 2))
    records = [{"step": s + 1, "expert_load": loads[s].tolist()} for s in (2, 0, 1)]
    records += [{"step": 3, "eval/loss": 1.0}, {"step": 4, "expert_load": [[], []]}]
    steps, got = load_series(records)
    assert steps == [1, 2, 3]
    np.testing.assert_allclose(got, loads)
    path = plots.plot_load_balance(steps, got, tmp_path / "load_balance.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    assert load_series([{"step": 1, "loss": 2.0}]) == (None, None)

@pytest.mark.slow
def test_a_run_trains_with_both_options_and_logs_the_load(tmp_path):
    """train.py's loop with the per-sequence loss and auxiliary-loss-free balancing, gradient
    accumulation over 2 micro-batches: it trains, metrics.jsonl has each layer's load per expert
    and its imbalance, and the checkpoint holds the biases the steps moved."""
    from dagmoe_jax.run.gin import load_configs
    from dagmoe_jax.train.loop import train
    from dagmoe_jax.run.records import read_metrics

    run_dir, steps, rate = tmp_path / "run", 4, 0.001
    configs = load_configs(["train/smoke.gin"], [
        f"RunConfig.steps = {steps}", f"RunConfig.run_dir = '{run_dir}'",
        "RunConfig.grad_accum = 2", "RunConfig.save_every = 4", "RunConfig.eval_every = 0",
        "RunConfig.task_eval_examples = 0", "RunConfig.tensorboard = False",
        "RunConfig.eval_batches = 1", "DataConfig.num_synthetic = 64",
        "ModelConfig.d_model = 16", "AggregationConfig.dag_dim = 8",
        "ExpertConfig.expert_hidden = 16", "RouterConfig.balance_scope = 'sequence'",
        f"RouterConfig.aux_free_bias_rate = {rate}"])
    train(*configs, progress=False, log=lambda _m: None)
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        load = np.asarray(r["expert_load"])
        assert load.shape == (2, 8) and np.allclose(load.sum(-1), 1.0)
        np.testing.assert_allclose(r["load_imbalance"], load.max(-1) / load.mean(-1))
        assert "router_counts" not in r and np.isfinite(r["loss"])
    loaded = run_lib.load_run(run_dir)
    assert loaded.model_cfg.block.router.balance_scope == "sequence"
    (bias,) = biases(loaded.model).values()
    moves = bias / rate                      # each step moved each bias by -rate, 0 or +rate
    assert bias.shape == (2, 8) and np.abs(bias).max() > 0
    np.testing.assert_allclose(moves, np.round(moves), atol=1e-3)
    assert np.abs(moves).max() <= steps + 1e-3
