"""Expert-parallel dropless dispatch by ragged all-to-all: its bookkeeping (sort, slice sizes,
offsets, the receiver's re-sort and the way back) checked on CPU, where XLA has no ragged
all-to-all, by running it with an emulation of the collective built from ``all_gather``, against
the single-device dispatch; and where settle chooses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from dagmoe_jax.model import expert_parallel
from dagmoe_jax.config import ExecutionConfig, ExpertConfig
from dagmoe_jax.model.experts import Experts
from dagmoe_jax.parallel import MeshConfig, activate, make_mesh, place_on_mesh
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.run.settle import describe, settle

N = 8

# One device's reference choices, with the ragged all-to-all exchange.
RAGGED = ExecutionConfig(fuse_projections=True, grouped_matmul="ragged_dot",
                         expert_exchange="ragged_all_to_all")


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s documented semantics (one slice per device): slice i of
    every device's ``operand`` lands on device i at that sender's ``output_offsets[i]``; the
    receiver takes ``recv_sizes[src]`` rows from sender src (what it must agree on)."""
    size = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    gather = lambda a: jax.lax.all_gather(a, axis_name, axis=0, tiled=False)  # noqa: E731
    del send_sizes                                        # the receiver's count is used
    operands, starts, places = map(gather, (operand, input_offsets, output_offsets))
    rows = jnp.arange(operand.shape[0])
    for src in range(size):
        start, n, place = starts[src, me], recv_sizes[src], places[src, me]
        dest = jnp.where((rows >= start) & (rows < start + n), place + rows - start,
                         output.shape[0])
        output = output.at[dest].set(operands[src], mode="drop")
    return output


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=2, expert=4),
                                      MeshConfig(data=2, expert=2, tensor=2)],
                         ids=["dp2_ep4", "dp2_ep2_tp2"])
def test_ragged_exchange_equals_single_device_dispatch(monkeypatch, mesh_cfg):
    monkeypatch.setattr(expert_parallel, "ragged_all_to_all", emulated_ragged_all_to_all)
    mesh = make_mesh(mesh_cfg)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 32)), jnp.float32)
    # skewed routing: experts 0-2 take most assignments, expert 7 none (an empty group and
    # uneven slices between the shards)
    idx = jnp.asarray(np.stack([rng.choice(7, 2, replace=False, p=[.3, .3, .2, .05, .05, .05, .05])
                                for _ in range(32)]), jnp.int32)
    probe = jnp.asarray(rng.normal(size=(32, 2, 32)), jnp.float32)

    def loss_and_grads(experts, x):
        def loss(e, x):
            out, keep = e(x, idx)
            return jnp.sum(out * probe), (out, keep)
        (_, (out, keep)), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            experts, x)
        return out, keep, grads

    e_cfg = ExpertConfig(num_experts=N, expert_hidden=16, dispatch="dropless")
    local = Experts(e_cfg, 32, std=0.2, dtype=jnp.float32, rngs=nnx.Rngs(0))
    out_ref, _, (g_ref, gx_ref) = loss_and_grads(local, x)
    sharded = Experts(e_cfg, 32, std=0.2, dtype=jnp.float32, execution=RAGGED, rngs=nnx.Rngs(0),
                      layout=MeshLayout.of(mesh))
    place_on_mesh(sharded, mesh)
    with activate(mesh):
        step = nnx.jit(loss_and_grads)
        out, keep, (g, gx) = step(sharded, x)
    assert bool(jnp.all(keep))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-4, atol=1e-5)
    for name in ("w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(np.asarray(getattr(g, name)[...]),
                                   np.asarray(getattr(g_ref, name)[...]), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_the_ragged_exchange_is_what_the_sharded_dispatch_traces():
    """Without the emulation the model's dispatch traces the real collective (lowering for
    TPU / CUDA: tests/test_lowering.py)."""
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    experts = Experts(ExpertConfig(num_experts=N, expert_hidden=16, dispatch="dropless"), 32,
                      std=0.2, dtype=jnp.float32, execution=RAGGED, rngs=nnx.Rngs(0),
                      layout=MeshLayout.of(mesh))
    idx = jnp.zeros((16, 2), jnp.int32).at[:, 1].set(1)
    with activate(mesh):
        text = str(jax.make_jaxpr(lambda x: experts(x, idx))(jnp.ones((16, 32))))
    assert text.count("ragged_all_to_all") == 2 and "reduce_scatter" not in text


def test_settle_picks_the_exchange_per_backend():
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    layout = MeshLayout.of(mesh)
    cfg = tiny_config(experts=dict(dispatch="dropless"))
    assert settle(cfg, backend="gpu", layout=layout).expert_exchange == "ragged_all_to_all"
    assert settle(cfg, backend="tpu", layout=layout).expert_exchange == "ragged_all_to_all"
    cpu = settle(cfg, backend="cpu", layout=layout)
    assert cpu.expert_exchange == "all_gather"
    assert describe(cfg, cpu, None, "cpu", layout).endswith("by all_gather")
    chosen = ExecutionConfig(expert_exchange="all_gather")
    assert settle(cfg, chosen, backend="gpu").expert_exchange == "all_gather"
