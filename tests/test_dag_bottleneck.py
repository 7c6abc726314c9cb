"""The DAG module computed in its bottleneck space (``dag_module='bottleneck'``,
dagmoe_jax/families/moe/dag/bottleneck.py) against the paper's eq. 6-12 as written.

test_dag.py runs the strategy through every test of the module (values against the NumPy
transcription for L = 1..3, each edge mode, shared weights, the zero-init identity). Here:
its gradients against central differences of that float64 transcription, against the composed
strategy's autodiff, bfloat16 rounding, nodes whose mean is far from zero, the whole MoE block
at initialisation, and a 50-step training run against the composed strategy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from test_dag import (EPS, make_dag, np_dag_moe, random_inputs, random_lib_params, rel_err,
                      to_paper_layout)

from dagmoe_jax.families.moe.aggregation import weighted_sum

NAMES = ("x", "gates", "expert_out", "ln_scale", "ln_bias", "w_down", "w_edge", "w_node",
         "w_up")


def np_loss(args, probe, edge_act, edges, shared, iters):
    """<probe, eq. 6-12's 'once' output> in float64, from the arguments by name."""
    lib = {n: args[n] for n in NAMES[3:]}
    if shared:
        lib = {n: np.stack([v] * iters) for n, v in lib.items()}
    y = np_dag_moe(args["x"], args["gates"], args["expert_out"], to_paper_layout(lib),
                   edge_act, edges=edges)
    return float(np.sum(y * probe))


def module_loss(mode, iters, edge_act, edges, shared):
    """The same scalar through the library's module run as ``mode``, a function of the
    arguments by name (jitted)."""
    def loss(args, probe):
        module = make_dag(iters, edge_act, None, edges=edges, shared=shared, mode=mode)
        graphdef, params = nnx.split(module, nnx.Param)
        params["iterations"] = {n: nnx.Param(args[n]) for n in NAMES[3:]}
        y = nnx.merge(graphdef, params)(args["x"], args["gates"], args["expert_out"])[0]
        return jnp.sum(y * probe)
    return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("iters,edges,shared", [(1, "all", False), (2, "all", False),
                                                (3, "all", False), (2, "ranked", False),
                                                (2, "self", False), (3, "all", True)])
def test_every_gradient_equals_central_differences_of_the_transcription(iters, edges, shared):
    """d<probe, y>/d(every input and weight) of the bottleneck strategy, float32, against
    central differences of the float64 NumPy transcription along a random direction per
    argument (eq. 6-12 as the paper writes them; no library code in the reference)."""
    rng = np.random.default_rng(200 + iters)
    x, gates, expert_out = random_inputs(rng, t=3, k=3)
    lib = random_lib_params(rng, 1 if shared else iters)
    if shared:
        lib = {n: v[0] for n, v in lib.items()}
    args = {"x": x, "gates": gates, "expert_out": expert_out, **lib}
    args = {n: np.asarray(v, np.float64) for n, v in args.items()}
    probe = rng.normal(size=x.shape)
    value, grads = module_loss("bottleneck", iters, "silu", edges, shared)(
        {n: jnp.asarray(v, jnp.float32) for n, v in args.items()},
        jnp.asarray(probe, jnp.float32))
    assert abs(float(value) - np_loss(args, probe, "silu", edges, shared, iters)) < 1e-4 * (
        1 + abs(float(value)))
    for name in NAMES:
        direction = rng.normal(size=args[name].shape)
        step = 1e-5
        plus = {**args, name: args[name] + step * direction}
        minus = {**args, name: args[name] - step * direction}
        numeric = (np_loss(plus, probe, "silu", edges, shared, iters)
                   - np_loss(minus, probe, "silu", edges, shared, iters)) / (2 * step)
        analytic = float(np.sum(np.asarray(grads[name], np.float64) * direction))
        assert abs(numeric) > 1e-3, name           # the direction really moves the output
        assert abs(analytic - numeric) <= 2e-4 * max(1.0, abs(numeric)), (name, analytic,
                                                                          numeric)


@pytest.mark.parametrize("edge_act", ["silu", "sigmoid"])
@pytest.mark.parametrize("iters", [1, 2, 3])
def test_gradients_equal_the_composed_strategy(edge_act, iters):
    """Values and every gradient equal the composed iteration's ('xla') on a larger problem."""
    rng = np.random.default_rng(300 + iters)
    x, gates, expert_out = random_inputs(rng, t=29, k=4)
    args = {"x": x, "gates": gates, "expert_out": expert_out,
            **random_lib_params(rng, iters)}
    args = {n: jnp.asarray(v) for n, v in args.items()}
    probe = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    got = module_loss("bottleneck", iters, edge_act, "all", False)(args, probe)
    want = module_loss("xla", iters, edge_act, "all", False)(args, probe)
    assert abs(float(got[0]) - float(want[0])) < 1e-5 * abs(float(want[0]))
    for name in NAMES:
        assert float(jnp.max(jnp.abs(want[1][name]))) > 0, name
        assert rel_err(got[1][name], want[1][name]) < 2e-5, name


def test_nodes_whose_mean_is_ten_spreads_off_zero_stay_within_tolerance():
    """The variance is E[x^2] - E[x]^2 from the expanded statistics (float32), whose
    rounding grows as (mu / sigma)^2: with every node's mean 10 standard deviations off zero
    the output still equals the transcription to 1e-4, and the experts' output gradient the
    composed strategy's to 1e-3 (2e-4 measured; 2e-5 at 3 sigma, 5e-7 centred)."""
    rng = np.random.default_rng(11)
    x, gates, expert_out = random_inputs(rng, t=7, k=4)
    offset = 10.0 * np.sqrt(2.0)     # the nodes g E + x / K have a spread of about 1 .. 1.4
    expert_out = expert_out + offset / gates[..., None]
    x = x + offset
    params = random_lib_params(rng, 2)
    want = np_dag_moe(x, gates, expert_out, to_paper_layout(params), "silu")
    nodes = gates[..., None] * expert_out + x[:, None, :] / 4
    assert np.all(np.abs(nodes.mean(-1)) > 8 * nodes.std(-1))
    inputs = [jnp.asarray(a) for a in (x, gates, expert_out)]
    got = make_dag(2, "silu", params, mode="bottleneck")(*inputs)[0]
    assert rel_err(got, want) < 1e-4
    probe = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def input_grad(mode):
        module = make_dag(2, "silu", params, mode=mode)
        return jax.grad(lambda e: jnp.sum(module(inputs[0], inputs[1], e)[0] * probe))(
            inputs[2])

    assert rel_err(input_grad("bottleneck"), input_grad("xla")) < 1e-3


@pytest.mark.parametrize("offset", [0.0, 14.0], ids=["centred", "mean-10-sigma"])
def test_bfloat16_is_within_the_composed_strategys_rounding(offset):
    """In bfloat16 compute the strategy rounds other intermediates than the composed
    iteration does (the experts' outputs' projections onto the centred C W_g, not each carried
    node): its error against the float64 transcription is within the composed strategies'
    (0.0072 against 0.0074-0.0076 centred; 0.0084 against 0.010-0.018 with the nodes' mean
    ten spreads off zero, where rounding each node to bfloat16 loses the spread's digits)."""
    rng = np.random.default_rng(12)
    x, gates, expert_out = random_inputs(rng, t=64, k=4)
    expert_out, x = expert_out + offset / gates[..., None], x + offset
    params = random_lib_params(rng, 2)
    want = np_dag_moe(x, gates, expert_out, to_paper_layout(params), "silu")
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, gates, expert_out)]
    errors = {}
    for mode in ("xla", "xla_rank3", "bottleneck"):
        got = make_dag(2, "silu", params, mode=mode)(*bf)[0]
        assert got.dtype == jnp.bfloat16
        errors[mode] = rel_err(np.asarray(got, np.float32), want)
    assert errors["bottleneck"] < 1e-2
    assert errors["bottleneck"] <= 1.2 * min(errors["xla"], errors["xla_rank3"]), errors


def test_the_model_with_zero_w_up_is_the_moe_model():
    """A DAG-MoE model run by the bottleneck strategy at initialisation (W_up = 0) computes
    the MoE model's logits, given the MoE model's weights: the module adds exactly nothing to
    eq. 1's weighted sum."""
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
    dag = make_model(tiny_config("moe", "dag"), dag_module="bottleneck")
    moe = make_model(tiny_config("moe", "sum"), seed=1)
    dag_params = dict(nnx.to_flat_state(nnx.state(dag, nnx.Param)))
    moe_params = nnx.to_flat_state(nnx.state(moe, nnx.Param))
    assert len(dag_params) > len(moe_params)             # the DAG module's own weights
    for path, var in moe_params:
        var.set_value(dag_params[path].get_value())
    nnx.update(moe, nnx.from_flat_state(moe_params))
    np.testing.assert_allclose(np.asarray(dag(batch)[0]), np.asarray(moe(batch)[0]), rtol=0,
                               atol=1e-5)


def test_the_module_output_moves_once_w_up_does():
    """Not the weighted sum once W_up is non-zero (the identity above is not vacuous)."""
    rng = np.random.default_rng(13)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, k=4))
    module = make_dag(2, "silu", random_lib_params(rng, 2), mode="bottleneck")
    assert rel_err(module(x, gates, expert_out)[0], weighted_sum(gates, expert_out)) > 0.1


def test_fifty_training_steps_equal_the_composed_strategy():
    """50 AdamW steps of a tiny DAG-MoE in float32 on this CPU: the losses of the bottleneck
    strategy equal the composed one's ('xla') to 1e-4, step by step."""
    from dagmoe_jax.train.step import make_train_step

    cfg = tiny_config("moe", "dag", aggregation=dict(dag_iters=2))
    rng = np.random.default_rng(1)
    batches = [{"inputs": jnp.asarray(rng.integers(0, 64, (4, 16)), jnp.int32),
                "targets": jnp.asarray(rng.integers(0, 64, (4, 16)), jnp.int32),
                "mask": jnp.ones((4, 16), bool)} for _ in range(5)]
    losses = {}
    for mode in ("xla", "bottleneck"):
        model = make_model(cfg, dag_module=mode)
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
        step = make_train_step()
        losses[mode] = np.array([float(step(model, optimizer, batches[i % 5])["ce_loss"])
                                 for i in range(50)])
    assert losses["xla"][-1] < losses["xla"][0] - 0.3          # it trained
    np.testing.assert_allclose(losses["bottleneck"], losses["xla"], rtol=0, atol=1e-4)


def test_recording_the_edge_gates_runs_the_composed_iteration():
    """Analysis records each iteration's edge gates and input nodes, which the strategy never
    builds: with ``record_intermediates`` the module runs the composed iteration, the same
    function."""
    rng = np.random.default_rng(14)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, k=4))
    params = random_lib_params(rng, 2)
    module = make_dag(2, "silu", params, mode="bottleneck")
    plain = module(x, gates, expert_out)[0]
    module.record_intermediates = True
    recorded, kept = module(x, gates, expert_out)
    assert kept["edge_gates"].shape == (2, x.shape[0], 4, 4, 16)
    assert kept["dag_inputs"].shape == (2, x.shape[0], 4, x.shape[1])
    assert rel_err(recorded, plain) < 1e-5
