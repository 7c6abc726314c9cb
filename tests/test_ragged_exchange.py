"""Expert-parallel dropless dispatch by ragged all-to-all: its bookkeeping (sort, slice sizes,
offsets, the receiver's groups in arrival order and the way back) checked on CPU, where XLA has no ragged
all-to-all, by running it with an emulation of the collective built from ``all_gather``, against
the single-device dispatch; and where settle chooses it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from dagmoe_jax.model.routed import expert_parallel
from dagmoe_jax.config import ExecutionConfig, ExpertConfig
from dagmoe_jax.model.routed.experts import Experts
from dagmoe_jax.parallel import MeshConfig, activate, make_mesh, place_on_mesh
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.model.settle import describe, settle

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
                                      MeshConfig(data=2, expert=2, tensor=2),
                                      MeshConfig(data=2, fsdp=2, tensor=2)],
                         ids=["dp2_ep4", "dp2_ep2_tp2", "no_expert_axis"])
@pytest.mark.parametrize("block", [1, 4], ids=["rows", "blocks"])
def test_ragged_exchange_equals_single_device_dispatch(monkeypatch, mesh_cfg, block):
    """Outputs and gradients equal the single-device dispatch's, rows moved one by one (GPU)
    or in blocks (TPU: each slice padded to whole blocks, the padding its own group)."""
    monkeypatch.setattr(expert_parallel, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(expert_parallel, "exchange_block", lambda *_: block)
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


# 16 tokens, each routed to experts 0 and 1: what the traced-program tests dispatch
TRACED_IDX = jnp.zeros((16, 2), jnp.int32).at[:, 1].set(1)


def traced_experts(mesh_cfg: MeshConfig):
    """(dropless Experts of d 32 on ``mesh_cfg``'s mesh with the ragged exchange, the mesh)."""
    mesh = make_mesh(mesh_cfg)
    return Experts(ExpertConfig(num_experts=N, expert_hidden=16, dispatch="dropless"), 32,
                   std=0.2, dtype=jnp.float32, execution=RAGGED, rngs=nnx.Rngs(0),
                   layout=MeshLayout.of(mesh)), mesh


def test_without_an_expert_axis_each_shard_dispatches_its_own_tokens_by_permutations():
    """On a mesh with no expert axis every assignment is the device's own: no collective moves
    tokens, and the gathers are whole permutations (no bounds select; on TPU each select was a
    pass over the rows, benchmarks/RESULTS.md)."""
    experts, mesh = traced_experts(MeshConfig(data=2, fsdp=4))
    with activate(mesh):
        jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(experts(x, TRACED_IDX)[0])))(
            jnp.ones((16, 32)))
    text = str(jaxpr)
    assert "shard_map" in text
    for absent in ("all_gather", "reduce_scatter", "all_to_all"):
        assert absent not in text, absent

    def gather_modes(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "gather":
                yield str(eqn.params["mode"])
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    yield from gather_modes(inner)

    modes = list(gather_modes(jaxpr.jaxpr))
    assert len(modes) >= 4 and all("PROMISE_IN_BOUNDS" in m for m in modes), modes


def test_the_ragged_exchange_is_what_the_sharded_dispatch_traces():
    """Without the emulation the model's dispatch traces the real collective (lowering for
    TPU / CUDA: tests/test_lowering.py). The only sorts are the sender's (its assignments by
    expert, and back): the receiver runs its grouped matmul on the rows where they landed,
    not re-sorted by local expert (four sorts and six gathers before)."""
    experts, mesh = traced_experts(MeshConfig(data=2, expert=4))
    with activate(mesh):
        text = str(jax.make_jaxpr(lambda x: experts(x, TRACED_IDX))(jnp.ones((16, 32))))
    assert text.count("ragged_all_to_all") == 2 and "reduce_scatter" not in text
    assert len(re.findall(r"\bsort\[", text)) == 2 and text.count("gather[") == 3


def test_settle_picks_the_exchange_per_backend():
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    layout = MeshLayout.of(mesh)
    cfg = tiny_config(experts=dict(dispatch="dropless"))
    assert settle(cfg, backend="gpu", layout=layout).expert_exchange == "ragged_all_to_all"
    assert settle(cfg, backend="tpu", layout=layout).expert_exchange == "ragged_all_to_all"
    cpu = settle(cfg, backend="cpu", layout=layout)
    assert cpu.expert_exchange == "all_gather"
    assert describe(cfg, cpu, None, "cpu", layout).endswith("by all_gather")
    bounded = tiny_config(experts=dict(dispatch="dropless", exchange_buffer=1.25))
    assert describe(bounded, cpu, None, "cpu", layout).endswith(
        "by all_gather, receive buffer 1.25x the balanced share (the overflow drops)")
    chosen = ExecutionConfig(expert_exchange="all_gather")
    assert settle(cfg, chosen, backend="gpu").expert_exchange == "all_gather"


def np_buffer_keep(idx: np.ndarray, groups: int, shards: int, n_local: int, cap: int):
    """ExpertConfig.exchange_buffer's rule, transcribed: in each expert group (``groups`` of
    ``shards`` devices, each holding T_loc consecutive tokens), the shard of experts
    [d * n_local, (d + 1) * n_local) keeps the first ``cap`` assignments in the order sending
    device, local expert, the sender's (token, k) order; the rest drop."""
    t, k = idx.shape
    t_loc = t // (groups * shards)
    keep = np.zeros((t, k), bool)
    for g in range(groups):
        for d in range(shards):
            taken = 0
            for s in range(shards):
                rows = slice((g * shards + s) * t_loc, (g * shards + s + 1) * t_loc)
                for j in range(d * n_local, (d + 1) * n_local):
                    for tt, kk in zip(*np.nonzero(idx[rows] == j)):
                        keep[rows.start + tt, kk] = taken < cap
                        taken += 1
    return keep


@pytest.mark.parametrize("exchange,block", [("ragged_all_to_all", 1), ("ragged_all_to_all", 4),
                                            ("all_gather", 1)],
                         ids=["ragged_rows", "ragged_blocks", "all_gather"])
def test_a_bounded_buffer_drops_by_its_rule_and_a_wide_one_is_dropless(monkeypatch, exchange,
                                                                       block):
    """ExpertConfig.exchange_buffer on a skewed routing (data 2 x expert 4, T_loc 4, K 2):
    factor 1 keeps 8 rows a shard, so the shards of the popular experts drop what the NumPy
    transcription of the rule drops, the kept outputs are the single-device dispatch's and the
    dropped ones zero, and the gradients are those of the kept outputs; factor 4 (= E, the
    worst case) is the dropless dispatch exactly. Both exchanges apply the same rule, the
    ragged one moving rows one by one or in blocks (whose padding takes no room)."""
    monkeypatch.setattr(expert_parallel, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(expert_parallel, "exchange_block", lambda *_: block)
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(32, 32)), jnp.float32)
    idx_np = np.stack([rng.choice(7, 2, replace=False, p=[.35, .3, .15, .05, .05, .05, .05])
                       for _ in range(32)]).astype(np.int32)
    idx = jnp.asarray(idx_np)
    execution = ExecutionConfig(fuse_projections=True, grouped_matmul="ragged_dot",
                                expert_exchange=exchange)
    reference = Experts(ExpertConfig(num_experts=N, expert_hidden=16), 32, std=0.2,
                        dtype=jnp.float32, rngs=nnx.Rngs(0))
    want, _ = reference(x, idx)
    for factor in (1.0, 4.0):
        cfg = ExpertConfig(num_experts=N, expert_hidden=16, exchange_buffer=factor)
        sharded = Experts(cfg, 32, std=0.2, dtype=jnp.float32, execution=execution,
                          rngs=nnx.Rngs(0), layout=MeshLayout.of(mesh))
        place_on_mesh(sharded, mesh)

        def loss(e, x):
            out, keep = e(x, idx)
            return jnp.sum(out ** 2), (out, keep)
        with activate(mesh):
            (_, (out, keep)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(sharded, x)
        rule = np_buffer_keep(idx_np, 2, 4, N // 4, int(np.ceil(factor * 4 * 2)))
        np.testing.assert_array_equal(np.asarray(keep), rule)
        if factor == 1.0:
            assert 0 < (~rule).sum() < rule.size // 2        # the skew really overflows
        np.testing.assert_allclose(np.asarray(out), np.where(rule[..., None], want, 0.0),
                                   rtol=1e-5, atol=1e-5)
        kept = lambda e, x: jnp.sum(jnp.where(rule[..., None], e(x, idx)[0], 0.0) ** 2)  # noqa
        want_grads = nnx.grad(kept)(reference, x)
        for name in ("w_gate", "w_up", "w_down"):
            np.testing.assert_allclose(np.asarray(getattr(grads, name)[...]),
                                       np.asarray(getattr(want_grads, name)[...]), rtol=1e-4,
                                       atol=1e-5, err_msg=name)
        assert np.abs(np.asarray(grads.w_down[...])).sum() > 0


def test_the_buffer_is_a_dropless_setting_of_at_least_one():
    for bad, needle in ((0.5, "a number >= 1"), (True, "a number >= 1"),
                        (2.0, "None with dispatch='capacity'")):
        with pytest.raises(ValueError, match=needle):
            ExpertConfig(exchange_buffer=bad, dispatch="capacity" if bad == 2.0 else "dropless")


def test_a_bounded_buffer_run_logs_its_drops(tmp_path):
    """train.py's loop on data 2 x expert 4 with a buffer of the balanced share: each layer's
    dropped share is in metrics.jsonl, and an untrained router's uneven load overflows it."""
    from dagmoe_jax.run.gin import load_configs
    from dagmoe_jax.train.loop import train
    from dagmoe_jax.run.records import read_metrics

    run_dir = tmp_path / "run"
    configs = load_configs(["train/smoke.gin"], [
        "RunConfig.steps = 3", f"RunConfig.run_dir = '{run_dir}'", "RunConfig.save_every = 3",
        "RunConfig.eval_every = 0", "RunConfig.task_eval_examples = 0",
        "RunConfig.tensorboard = False", "RunConfig.eval_batches = 1",
        "DataConfig.num_synthetic = 64", "ModelConfig.d_model = 16",
        "AggregationConfig.dag_dim = 8", "ExpertConfig.expert_hidden = 16",
        "ExpertConfig.dispatch = 'dropless'", "ExpertConfig.exchange_buffer = 1.0",
        "MeshConfig.expert = 4"])
    lines = []
    train(*configs, progress=False, log=lines.append)
    assert any("receive buffer 1x the balanced share" in line for line in lines), lines
    dropped = np.asarray([r["dropped_fraction"] for r in read_metrics(run_dir)
                          if "dropped_fraction" in r])
    assert dropped.shape == (3, configs[0].num_layers)
    assert 0 < dropped.max() < 0.5


def test_the_exchange_s_grouped_matmul_leaves_the_buffer_tail_unzeroed_and_nothing_reads_it(
        monkeypatch):
    """The ragged exchange runs megablox ``gmm`` with ``zero_tail=False``: the receive buffer's
    unused tail (the worst case's room) is left as ``gmm`` leaves it, and the buffers the two
    exchanges write into are uninitialised (``lax.empty``). Interpreted as a TPU runs it, with
    uninitialised memory NaN (``lax.empty`` too), the outputs and every gradient still equal
    the single-device dispatch's and are finite: nothing reads that tail, forward or
    backward."""
    import functools
    from jax.experimental.pallas import tpu as pltpu
    from dagmoe_jax.kernels import pallas
    from dagmoe_jax.model.routed import dispatch as dispatch_lib

    monkeypatch.setattr(expert_parallel, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(expert_parallel.jax.lax, "empty",
                        lambda shape, dtype: jnp.full(shape, jnp.nan, dtype))
    monkeypatch.setitem(dispatch_lib.GROUPED_MATMUL, "gmm", functools.partial(
        pallas.gmm_grouped_matmul, interpret=pltpu.InterpretParams(uninitialized_memory="nan")))
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    rng = np.random.default_rng(1)
    d, t = 128, 32
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(6, 2, replace=False) for _ in range(t)]), jnp.int32)
    probe = jnp.asarray(rng.normal(size=(t, 2, d)), jnp.float32)
    e_cfg = ExpertConfig(num_experts=N, expert_hidden=128, dispatch="dropless")

    def loss_and_grads(experts, x):
        loss = lambda e, x: jnp.sum(e(x, idx)[0] * probe)                  # noqa: E731
        return nnx.value_and_grad(loss, argnums=(0, 1))(experts, x)

    ref, (g_ref, gx_ref) = loss_and_grads(
        Experts(e_cfg, d, std=0.2, dtype=jnp.float32, rngs=nnx.Rngs(0)), x)
    sharded = Experts(e_cfg, d, std=0.2, dtype=jnp.float32, rngs=nnx.Rngs(0),
                      execution=ExecutionConfig(fuse_projections=False, grouped_matmul="gmm",
                                                expert_exchange="ragged_all_to_all"),
                      layout=MeshLayout.of(mesh))
    place_on_mesh(sharded, mesh)
    with activate(mesh):
        value, (g, gx) = nnx.jit(loss_and_grads)(sharded, x)
    np.testing.assert_allclose(float(value), float(ref), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-4, atol=1e-4)
    for name in ("w_gate", "w_up", "w_down"):
        grad = np.asarray(getattr(g, name)[...])
        assert np.all(np.isfinite(grad)), name
        np.testing.assert_allclose(grad, np.asarray(getattr(g_ref, name)[...]), rtol=1e-4,
                                   atol=1e-4, err_msg=name)
