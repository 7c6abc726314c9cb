"""The DAG iteration's Pallas Triton kernels (``ExecutionConfig.dag_module='triton'``,
dagmoe_jax/kernels/triton_dag_module.py), run in Pallas's interpreter on this CPU: the
iteration equals XLA's and the paper's NumPy transcription, values and every gradient; 'auto'
settles to it on one sm80+ GPU only where it takes the shape. The kernels compiled by XLA:GPU
for an A100 and an H100 are in tests/test_gpu_compile.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from dagmoe_jax.config import ExecutionConfig
from benchmarks.gpu_check import kernel_dag_iteration, xla_dag_iteration
from dagmoe_jax.kernels.triton_dag_module import DagTiles, triton_dag_unsupported
from dagmoe_jax.families.moe.aggregation import weighted_sum
from dagmoe_jax.families.moe.dag.execution import TritonExecution
from dagmoe_jax.model.settle import describe, settle, settle_dag_module
from dagmoe_jax.parallel.axes import MeshLayout
from test_dag import (make_dag, np_dag_moe, random_inputs, random_lib_params, rel_err,
                      to_paper_layout)

EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class InterpretedTriton(TritonExecution):
    """The 'triton' strategy with its kernels in the Pallas interpreter."""

    interpret = True


def iteration_args(rng, t, k, d, g, first=False, dtype=jnp.float32):
    """(carry, x [T, d], ln_scale, ln_bias, w_down, w_edge, w_node, w_up): a trained-looking
    iteration (W_up not zero, the LayerNorm not the identity); the carry r [T, K, d], or in
    the first iteration (gates [T, K], expert outputs [T, K, d])."""
    def a(*shape, scale=1.0):
        return jnp.asarray(rng.normal(size=shape) * scale, dtype)
    carry = ((jnp.asarray(rng.uniform(size=(t, k)), dtype), a(t, k, d)) if first
             else a(t, k, d))
    return (carry, a(t, d), jnp.asarray(1 + 0.2 * rng.normal(size=d), jnp.float32),
            jnp.asarray(0.2 * rng.normal(size=d), jnp.float32), a(d, g, scale=0.2),
            a(2 * g, g, scale=0.2), a(2 * g, g, scale=0.2), a(g, d, scale=0.2))


def values_and_grads(fn, args, cotangent, jit: bool = False):
    """``fn(*args)`` and its gradients for ``cotangent``; ``jit``: as one program (the Mosaic
    kernels' interpreter runs it in half the time; the Triton kernels', 1.5-5x slower)."""
    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return out, jax.tree.leaves(vjp(cotangent))
    return (jax.jit(run) if jit else run)(args, cotangent)


@pytest.mark.parametrize("edges,act,k,first,last", [
    ("all", "silu", 4, False, False), ("ranked", "sigmoid", 4, True, False),
    ("self", "silu", 2, False, True), ("all", "sigmoid", 4, True, True)])
def test_the_kernels_equal_xla_values_and_every_gradient(edges, act, k, first, last):
    """T = 13 tokens (not a whole number of tiles: padded), float32: forward and the gradients
    of the carry (or of eq. 6's gates and expert outputs, ``first``), of x and of all six
    weights within float32 rounding; ``last`` reads eq. 12's sum out."""
    rng = np.random.default_rng(len(edges) + k + 2 * first + last)
    t, d = 13, 64
    args = iteration_args(rng, t, k, d, 16, first)
    options = dict(edges=edges, edge_act=act, last=last, eps=EPS)
    ct = jnp.asarray(rng.normal(size=(t, d) if last else (t, k, d)), jnp.float32)
    want, want_grads = values_and_grads(functools.partial(xla_dag_iteration, **options), args,
                                        ct)
    got, got_grads = values_and_grads(
        functools.partial(kernel_dag_iteration, **options, interpret=True), args, ct)
    assert got.shape == want.shape and rel_err(got, want) < 1e-6
    # the iteration really moves the nodes (eq. 7-11 is exercised, not only the carry)
    assert rel_err(xla_dag_iteration(*args[:-1], 0 * args[-1], **options), want) > 0.1
    assert len(got_grads) == len(want_grads) == 8 + first
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert rel_err(a, b) < 1e-5, i


def rounds_where_xla_rounds(kernel, jit: bool = False) -> None:
    """In bfloat16 the iteration ``kernel`` (:func:`xla_dag_iteration`'s arguments) rounds at
    XLA's points (the LayerNorm's output, each projection, the messages, the update): both
    sit within bfloat16 rounding of the float32 iteration, and of each other; 40 tokens."""
    rng = np.random.default_rng(5)
    args32 = iteration_args(rng, 40, 4, 64, 32)
    args = tuple(a.astype(jnp.bfloat16) if a.ndim != 1 else a for a in args32)
    ct = jnp.asarray(rng.normal(size=args[0].shape), jnp.bfloat16)
    exact, exact_grads = values_and_grads(xla_dag_iteration, args32, ct.astype(jnp.float32),
                                          jit)
    want, want_grads = values_and_grads(xla_dag_iteration, args, ct, jit)
    got, got_grads = values_and_grads(kernel, args, ct, jit)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, exact) < 1e-2 and rel_err(want, exact) < 1e-2
    assert rel_err(got, want) < 1e-2
    for a, b, c in zip(got_grads, want_grads, exact_grads):
        assert rel_err(a, c) < 3e-2 and rel_err(a, b) < 3e-2


def test_bfloat16_rounds_where_xla_rounds():
    """:func:`rounds_where_xla_rounds` for the Triton kernels: several tiles of 16 rows, a
    32-wide column chunk."""
    rounds_where_xla_rounds(functools.partial(
        kernel_dag_iteration, tiles=DagTiles(rows=16, chunk=32), interpret=True))


def module_matches_transcription(kernels, iters: int, edges: str, reading: str) -> None:
    """DAGAggregator run by the whole-module strategy ``kernels`` (interpreted): eq. 6-12
    against the NumPy transcription of the paper, its gradients against the 'xla' strategy's,
    and at W_up = 0 the weighted sum (eq. 1)."""
    rng = np.random.default_rng(3 + iters)
    x, gates, expert_out = (jnp.asarray(a) for a in random_inputs(rng, k=4))
    params = random_lib_params(rng, iters)
    expected = np_dag_moe(np.asarray(x), np.asarray(gates), np.asarray(expert_out),
                          to_paper_layout(params), "silu", edges=edges, reading=reading)

    def build(params, mode):
        module = make_dag(iters, "silu", params, edges=edges, reading=reading, mode="xla")
        module.ex = kernels if mode == "kernels" else module.ex
        return module

    module = build(params, "kernels")
    assert rel_err(module(x, gates, expert_out)[0], expected) < 1e-5

    def loss(module, x, gates, expert_out):
        return jnp.sum(jnp.sin(module(x, gates, expert_out)[0]))

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2, 3)))
    grads = {mode: grad(build(params, mode), x, gates, expert_out) for mode in ("xla", "kernels")}
    for a, b in zip(jax.tree.leaves(grads["kernels"]), jax.tree.leaves(grads["xla"])):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5

    zero = dict(params, w_up=np.zeros_like(params["w_up"]))
    got = build(zero, "kernels")(x, gates, expert_out)[0]
    want = weighted_sum(gates, expert_out) + (x if reading == "literal" else 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("iters,edges,reading", [(1, "all", "once"), (2, "ranked", "literal"),
                                                 (3, "all", "once")])
def test_the_module_run_by_the_kernels_matches_the_papers_transcription(iters, edges, reading):
    """The 'triton' strategy (:func:`module_matches_transcription`) at L = 1 (one kernel both
    first and last), 2 and 3 (the middle iteration scanned)."""
    module_matches_transcription(InterpretedTriton(), iters, edges, reading)


def dag_config(**aggregation):
    return tiny_config("moe", "dag", d_model=64, compute_dtype="bfloat16",
                       aggregation={"dag_dim": 32, **aggregation}, router=dict(top_k=4))


def test_auto_settles_to_xla_on_a_gpu_and_the_kernels_only_when_asked_for():
    """On an H200 XLA's iteration ran 3.3x faster than the kernels (benchmarks/RESULTS.md):
    'auto' keeps XLA's module ('bottleneck', XLA's in d_g) on every GPU; an explicit 'triton'
    is kept where the kernels take the shape."""
    cfg, bf16 = dag_config(), jnp.bfloat16
    layout = MeshLayout(jax.sharding.AbstractMesh((2,), ("data",)))
    assert settle_dag_module("auto", cfg, "gpu", bf16, None) == "bottleneck"
    assert settle_dag_module("auto", cfg, "gpu", bf16, layout) == "bottleneck"
    assert settle_dag_module("triton", cfg, "gpu", bf16, None) == "triton"
    assert settle_dag_module("auto", cfg, "tpu", bf16, None) == "xla_rank3"
    assert "d_g a power of two" in triton_dag_unsupported(64, 48, 4, bf16)
    assert "K (top_k) a power of two" in triton_dag_unsupported(64, 32, 6, bf16)
    assert triton_dag_unsupported(64, 32, 4, bf16) is None
    # a model with no DAG module keeps 'xla' (what it settles to is never used)
    plain = tiny_config("moe", "sum", compute_dtype="bfloat16")
    assert settle(plain, ExecutionConfig(), backend="gpu").dag_module == "xla"


def test_the_run_line_names_the_dag_module_on_a_gpu():
    from types import SimpleNamespace
    hopper = SimpleNamespace(platform="gpu", compute_capability="9.0")
    cfg, auto = dag_config(), ExecutionConfig()
    line = describe(cfg, settle(cfg, auto, backend="gpu", device=hopper), auto, "gpu",
                    device=hopper)
    assert "DAG module bottleneck (XLA's in the bottleneck space" in line, line
    kernels = ExecutionConfig(dag_module="triton")
    line = describe(cfg, settle(cfg, kernels, backend="gpu", device=hopper), kernels, "gpu",
                    device=hopper)
    assert "DAG module triton" in line, line


def test_an_explicit_triton_it_cannot_run_is_one_line():
    bf16 = jnp.bfloat16
    layout = MeshLayout(jax.sharding.AbstractMesh((2,), ("data",)))
    with pytest.raises(ValueError, match=r"^ExecutionConfig.dag_module='triton' runs on a single "
                                         r"device only; use 'auto' or 'bottleneck' under a device "
                                         r"mesh$"):
        settle_dag_module("triton", dag_config(), "gpu", bf16, layout)
    with pytest.raises(ValueError, match=r"^ExecutionConfig.dag_module='triton': the Triton DAG "
                                         r"kernels need d_g a power of two >= 16 \(got 48\)"):
        settle_dag_module("triton", dag_config(dag_dim=48), "gpu", bf16, None)
    with pytest.raises(ValueError, match="use ExecutionConfig.dag_module='xla'$"):
        kernel_dag_iteration(*iteration_args(np.random.default_rng(0), 4, 3, 64, 16),
                             interpret=True)


def test_the_strategy_is_registered():
    module = make_dag(2, "silu", mode="triton")
    assert module.ex.name == "triton" and module.ex.whole_module
    assert nnx.graphdef(nnx.clone(module)) == nnx.graphdef(module)
