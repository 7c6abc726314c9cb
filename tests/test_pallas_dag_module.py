"""The DAG iteration's Pallas Mosaic kernels (``ExecutionConfig.dag_module='pallas'``,
dagmoe_jax/kernels/pallas_dag_module.py), run in Pallas's interpreter on this CPU: the
iteration equals XLA's and the paper's NumPy transcription, values and every gradient, on one
device and inside a mesh's ``shard_map``; 'auto' settles to it on TPU where it takes the
shape. The kernels compiled by XLA:TPU and Mosaic for a v5p are in tests/test_compile.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from benchmarks.gpu_check import xla_dag_iteration
from conftest import tiny_config
from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.kernels.pallas_dag_module import pallas_dag_iteration, pallas_dag_unsupported
from dagmoe_jax.families.moe.dag.equations import dag_pair_weights
from dagmoe_jax.families.moe.dag.execution import PallasExecution
from dagmoe_jax.model.settle import settle, settle_dag_module
from dagmoe_jax.parallel import MeshConfig, activate, make_mesh
from test_dag import make_dag, random_inputs, random_lib_params, rel_err
from test_triton_dag_module import (iteration_args, module_matches_transcription,
                                    rounds_where_xla_rounds, values_and_grads)

EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class InterpretedPallas(PallasExecution):
    """The 'pallas' strategy with its kernels in Pallas's TPU interpreter (the HLO
    interpreter, ``interpret=True``, does not run inside a ``shard_map`` that checks how
    values vary over its axes)."""

    interpret = pltpu.InterpretParams()


def node_major(a):
    return jnp.transpose(a, (1, 0, 2))


def kernel_iteration(carry, x, ln_scale, ln_bias, w_down, w_edge, w_node, w_up, *,
                     last=False, **options):
    """The kernels' iteration with :func:`xla_dag_iteration`'s arguments and layout ([T, K, .]
    in and out; the kernels take and give [K, T, .])."""
    if isinstance(carry, tuple):
        carry = (jnp.transpose(carry[0])[..., None], node_major(carry[1]))
    else:
        carry = node_major(carry)
    out = pallas_dag_iteration(carry, x, ln_scale, ln_bias, w_down,
                               dag_pair_weights(w_edge, w_node), w_up, eps=EPS, last=last,
                               tokens_per_program=8, interpret=True, **options)
    return out if last else node_major(out)


@pytest.mark.parametrize("edges,act,first,last", [
    ("all", "silu", False, False), ("ranked", "sigmoid", True, False),
    ("self", "silu", False, True), ("all", "sigmoid", True, True)])
def test_the_kernels_equal_xla_values_and_every_gradient(edges, act, first, last):
    """T = 13 tokens (not a whole number of programs of 8: padded), K = 4, float32: forward
    and the gradients of the carry (or of eq. 6's gates and expert outputs, ``first``), of x
    and of all six weights within float32 rounding; ``last`` reads eq. 12's sum out."""
    rng = np.random.default_rng(len(edges) + 2 * first + last)
    t, k, d = 13, 4, 64
    args = iteration_args(rng, t, k, d, 16, first)
    options = dict(edges=edges, edge_act=act, last=last)
    ct = jnp.asarray(rng.normal(size=(t, d) if last else (t, k, d)), jnp.float32)
    want, want_grads = values_and_grads(functools.partial(xla_dag_iteration, eps=EPS,
                                                          **options), args, ct)
    got, got_grads = values_and_grads(functools.partial(kernel_iteration, **options), args, ct)
    assert got.shape == want.shape and rel_err(got, want) < 1e-6
    # the iteration really moves the nodes (eq. 7-11 is exercised, not only the carry)
    assert rel_err(xla_dag_iteration(*args[:-1], 0 * args[-1], eps=EPS, **options), want) > 0.1
    assert len(got_grads) == len(want_grads) == 8 + first
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert rel_err(a, b) < 1e-5, i


def test_bfloat16_rounds_where_xla_rounds():
    """:func:`~test_triton_dag_module.rounds_where_xla_rounds` for the Mosaic kernels: five
    programs of 8 tokens."""
    rounds_where_xla_rounds(kernel_iteration, jit=True)


def build(params, mode, iters, edges="all", reading="once", shared=False):
    module = make_dag(iters, "silu", params, edges=edges, reading=reading, mode="xla",
                      shared=shared)
    module.ex = InterpretedPallas() if mode == "pallas" else module.ex
    return module


def loss(module, x, gates, expert_out):
    return jnp.sum(jnp.sin(module(x, gates, expert_out)[0]))


@pytest.mark.parametrize("iters,edges,reading", [(1, "all", "once"), (2, "ranked", "literal"),
                                                 (3, "all", "once")])
def test_the_module_run_by_the_kernels_matches_the_papers_transcription(iters, edges, reading):
    """DAGAggregator with the 'pallas' strategy (interpreted): eq. 6-12 against the NumPy
    transcription of the paper at L = 1 (one kernel both first and last), 2 and 3 (the middle
    iteration scanned), its gradients against the 'xla' strategy's, and at W_up = 0 the
    weighted sum (eq. 1)."""
    module_matches_transcription(InterpretedPallas(), iters, edges, reading)


def test_on_a_mesh_each_device_runs_its_own_tokens():
    """Under a data x fsdp mesh the kernels run inside a ``shard_map`` over the row axes, each
    device on its own 2 of the 16 tokens: the module's output and every gradient (the weights'
    summed across devices) equal one device's, shared weights too. (Jitted: the same program
    eagerly, op by op, took 4x the time.)"""
    rng = np.random.default_rng(11)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, t=16, k=4))
    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    for shared in (False, True):
        params = random_lib_params(rng, 2)
        params = {name: value[0] for name, value in params.items()} if shared else params
        want = step(build(params, "xla", 2, shared=shared), x, gates, expert_out)
        with activate(make_mesh(MeshConfig(data=2, fsdp=4))):
            got = step(build(params, "pallas", 2, shared=shared), x, gates, expert_out)
            text = jax.jit(lambda x: build(params, "pallas", 2, shared=shared)(
                x, gates, expert_out)[0]).lower(x).as_text()
        assert "sdy.manual_computation" in text or "shard_map" in text
        assert rel_err(got[0], want[0]) < 1e-5
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
            assert a.shape == b.shape and rel_err(a, b) < 1e-5


def dag_config(d_model=128, dag_dim=128):
    return tiny_config("moe", "dag", d_model=d_model, compute_dtype="bfloat16",
                       aggregation={"dag_dim": dag_dim}, router=dict(top_k=4))


def test_auto_keeps_xla_on_tpu_and_the_kernels_only_when_asked_for():
    """The kernels are estimated, not measured, on a TPU: 'auto' is XLA's rank-3 module even
    where they take the shape; an explicit 'pallas' is kept where they do."""
    bf16 = jnp.bfloat16
    assert settle_dag_module("auto", dag_config(), "tpu", bf16, None) == "xla_rank3"
    assert settle(dag_config(), ExecutionConfig(), backend="tpu").dag_module == "xla_rank3"
    assert settle_dag_module("pallas", dag_config(), "tpu", bf16, None) == "pallas"
    # d_g 64 is half a lane tile: the kernels cannot take it
    assert settle_dag_module("auto", dag_config(dag_dim=64), "tpu", bf16, None) == "xla_rank3"
    assert "multiples of 128 (got 128 and 64)" in pallas_dag_unsupported(128, 64, bf16)
    assert settle_dag_module("auto", dag_config(), "gpu", bf16, None) == "bottleneck"


def test_an_explicit_pallas_it_cannot_run_is_one_line():
    bf16 = jnp.bfloat16
    with pytest.raises(ValueError, match=r"^ExecutionConfig.dag_module='pallas': it runs on TPU "
                                         r"only; use 'auto' or 'xla_rank3'$"):
        settle_dag_module("pallas", dag_config(), "cpu", bf16, None)
    with pytest.raises(ValueError, match=r"^ExecutionConfig.dag_module='pallas': the Pallas DAG "
                                         r"kernels need d_model and d_g multiples of 128"):
        settle_dag_module("pallas", dag_config(d_model=64), "tpu", bf16, None)


def test_the_strategy_is_registered():
    module = make_dag(2, "silu", mode="pallas")
    assert module.ex.name == "pallas" and module.ex.whole_module
    assert nnx.graphdef(nnx.clone(module)) == nnx.graphdef(module)
