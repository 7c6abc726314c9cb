"""Sharded training on 8 simulated CPU devices equals training on one (docs/design.md section 8).

conftest.py starts JAX with ``--xla_force_host_platform_device_count=8``. For each mesh (dp 8,
ep 8, dp 2 x ep 4, fsdp 2 x ep 2 x tp 2) and block (MoE with capacity and with dropless dispatch,
DAG-MoE with a shared expert, CoE), one training step from the same parameters gives the same
metrics, gradients, updated parameters and layouts as the single-device step. The step uses SGD
with learning rate 1 and momentum, so after it the momentum is the gradient and the parameters
moved by minus the gradient; the DAG's zero-initialised w_up is randomised first, or the DAG
would get no gradient.

Tolerances (observed in brackets): loss terms and gradient norm 1e-5 relative [2e-7]; each
gradient within 1e-5 of the largest entry of its parameter's gradient [6e-7]; updated parameters
within that plus 2 float32 ulps of the parameter [40% of it]; expert load and dropped fraction
exactly. The differences come from float summation order (sharded matmuls, all-reduces).

Capacity dispatch under a mesh fills one buffer per device (per-device token groups, as GShard),
so which assignments drop can differ from one global group: the equality tests use
capacity_factor = N (C >= the group's token count: nothing can drop), and
``test_capacity_drops_per_device_group`` checks the drops themselves against single-device
dispatch run group by group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_model, tiny_config, tiny_execution
from dagmoe_jax.model import Transformer
from dagmoe_jax.model.routed.dispatch import capacity_dispatch
from dagmoe_jax.config import ExpertConfig
from dagmoe_jax.model.routed.experts import Experts
from dagmoe_jax.model.block import BlockInputs
from dagmoe_jax.families.moe.block import MoEBlock
from dagmoe_jax.parallel import (MeshConfig, activate, create_sharded, create_train_state,
                                 make_mesh, parallel_active, place_on_mesh, shard_batch)
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.train.step import make_train_step

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

N = 8  # experts: ep 8 puts one on each device
MESHES = {
    "dp8": MeshConfig(data=8),
    "ep8": MeshConfig(data=1, expert=8),
    "dp2_ep4": MeshConfig(data=2, expert=4),
    "fsdp2_ep2_tp2": MeshConfig(data=1, fsdp=2, expert=2, tensor=2),
}
VARIANTS = {   # unsettled: each test settles them for its layout, as a run does
    "moe_capacity": lambda: tiny_config("moe", "sum",
                                        experts=dict(num_experts=N, capacity_factor=N)),
    "moe_dropless": lambda: tiny_config("moe", "sum",
                                        experts=dict(num_experts=N, dispatch="dropless")),
    "dag": lambda: tiny_config("moe", "dag",
                               experts=dict(num_experts=N, num_shared=1, capacity_factor=N)),
    "coe": lambda: tiny_config("coe", "sum",
                               experts=dict(num_experts=N, dispatch="dropless")),
}
# DeepSeek-V3's routing: groups ranked by their top-2 biased scores, renormalised, scaled,
# beside a shared expert (capacity dispatch: tests/test_router.py, on one device)
DEEPSEEK_ROUTER = dict(score_fn="sigmoid", n_group=4, topk_group=2, group_score="top2_sum",
                       renormalize=True, routed_scaling_factor=2.5, aux_free_bias_rate=0.001)
VARIANTS["deepseek_dropless"] = lambda: tiny_config(
    "moe", "sum", router=DEEPSEEK_ROUTER,
    experts=dict(num_experts=N, num_shared=1, dispatch="dropless"))
# multi-head latent attention (its heads split over the tensor axis) with DeepSeek's routing
# and a multi-token prediction module (its layer's experts split as the layers' are)
VARIANTS["mla"] = lambda: tiny_config(
    "moe", "sum", router=DEEPSEEK_ROUTER,
    experts=dict(num_experts=N, num_shared=1, dispatch="dropless")).replace(
        mla=dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=6), mtp=dict(depth=1))
VARIANTS["dag_bottleneck"] = VARIANTS["dag"]          # the same model, its module in d_g
EXECUTION = {"dag_bottleneck": dict(dag_module="bottleneck")}   # else each layout's 'auto'
TX = optax.sgd(1.0, momentum=0.5)   # first step: new params = params - grads; momentum = grads


def make_batch(rows: int = 8, seq: int = 8) -> dict:
    rng = np.random.default_rng(0)
    mask = np.ones((rows, seq), bool)
    mask[::3, : seq // 4] = False          # some padding: the loss is a masked mean
    return {"inputs": rng.integers(0, 64, (rows, seq), dtype=np.int32),
            "targets": rng.integers(0, 64, (rows, seq), dtype=np.int32), "mask": mask}


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def variant_model(variant: str, mesh=None) -> Transformer:
    """The variant's model, built for ``mesh`` (None: one device) as a run builds it."""
    layout = MeshLayout.of(mesh)
    model = make_model(VARIANTS[variant](), layout=layout, **EXECUTION.get(variant, {}))
    if variant.startswith("dag"):   # w_up starts at zero: the DAG would get no gradients
        w_up = model.layers.block.aggregator.iterations.w_up
        w_up[...] = 0.05 * jax.random.normal(jax.random.key(7), w_up.shape)
    return model


_REFERENCE: dict = {}


def reference(variant: str) -> dict:
    """Initial params, metrics, updated params and momentum of one single-device step (cached)."""
    if variant not in _REFERENCE:
        model = variant_model(variant)
        optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
        params0 = host(nnx.state(model, nnx.Param))
        batch = {k: jnp.asarray(v) for k, v in make_batch().items()}
        metrics = make_train_step()(model, optimizer, batch)
        _REFERENCE[variant] = dict(params0=params0, metrics=host(metrics),
                                   params1=host(nnx.state(model, nnx.Param)),
                                   grads=host(optimizer.opt_state[0].trace))
    return _REFERENCE[variant]


def assert_tree_close(actual, expected, scale, what: str, rtol: float, ulps: float = 0.0):
    """Per leaf: max |actual - expected| <= rtol * max |scale| + ulps * (float32 spacing at
    max |expected|)."""
    leaves = zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected),
                 jax.tree.leaves(scale))
    for (path, a), e, sc in leaves:
        a, e = np.asarray(a), np.asarray(e)
        tol = rtol * np.max(np.abs(sc)) + ulps * np.spacing(np.max(np.abs(e)).astype(np.float32))
        err = np.max(np.abs(a - e))
        assert err <= tol, f"{what} {jax.tree_util.keystr(path)}: max error {err:.3g} > {tol:.3g}"


EXPECTED_SPECS = {   # written out, not derived from the rules: a rule change must fail here
    ("layers", "block", "experts", "w_gate"): P(None, "expert", "fsdp", "tensor"),
    ("layers", "block", "experts", "w_down"): P(None, "expert", "tensor", "fsdp"),
    ("layers", "block", "router", "w_router"): P(None, "fsdp", None),
    ("layers", "block", "routers", "0", "w_router"): P(None, "fsdp", None),
    ("layers", "block", "aggregator", "iterations", "w_down"): P(None, None, "fsdp", None),
    ("layers", "block", "aggregator", "iterations", "w_up"): P(None, None, None, "fsdp"),
    ("layers", "block", "aggregator", "iterations", "w_edge"): P(),
    ("layers", "block", "shared", "w_gate"): P(None, "fsdp", "tensor"),
    ("layers", "attn", "w_q"): P(None, "fsdp", "tensor", None),
    ("embed",): P("tensor", "fsdp"),
    ("lm_head",): P("fsdp", "tensor"),
}


def check_shardings(mesh, *trees):
    """Every array of ``trees`` (param-shaped states) listed in EXPECTED_SPECS has that layout,
    and the expert weights really are split N / expert per device."""
    for tree in trees:
        flat = {tuple(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(tree)}
        for path, spec in EXPECTED_SPECS.items():
            if path in flat:
                array = flat[path]
                assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), \
                    (path, array.sharding.spec, spec)
        w = flat[("layers", "block", "experts", "w_gate")]
        assert w.sharding.shard_shape(w.shape)[1] == N // mesh.shape["expert"], w.sharding


@pytest.fixture(scope="module")
def meshes():
    return {name: make_mesh(cfg) for name, cfg in MESHES.items()}


# Every variant on every mesh with an expert axis; on the data-parallel mesh, where each
# device runs the whole block as one device does and only the gradients' all-reduce is new,
# the DAG-MoE alone (the other three's data-parallel steps are dp2_ep4's data axis).
# The DAG module in d_g ('bottleneck', pure XLA, partitioned from its inputs' shardings) on
# the mesh that splits the tokens and the model dimension both.
SHARDED_CASES = [(m, v) for m in MESHES for v in VARIANTS
                 if v not in ("dag_bottleneck", "mla", "deepseek_dropless")
                 and (m != "dp8" or v == "dag")] + [
    ("fsdp2_ep2_tp2", "dag_bottleneck"), ("dp2_ep4", "deepseek_dropless"),
    ("fsdp2_ep2_tp2", "mla")]


@pytest.mark.parametrize("mesh_name,variant", SHARDED_CASES)
def test_sharded_step_matches_single_device(meshes, mesh_name, variant):
    mesh, ref = meshes[mesh_name], reference(variant)
    model = variant_model(variant, mesh)           # the reference's starting point
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    place_on_mesh((model, optimizer), mesh)     # (create_train_state: test_sharded_init_...)
    with activate(mesh):
        metrics = host(make_train_step()(model, optimizer, shard_batch(make_batch(), mesh)))
    for key in ("loss", "ce_loss", "balance_loss", "z_loss", "grad_norm", "mtp_loss"):
        if key in ref["metrics"]:
            np.testing.assert_allclose(metrics[key], ref["metrics"][key], rtol=1e-5,
                                       err_msg=key)
    for key in ("expert_load", "dropped_fraction"):
        np.testing.assert_array_equal(metrics[key], ref["metrics"][key], err_msg=key)
    assert np.all(metrics["dropped_fraction"] == 0)
    grads = optimizer.opt_state[0].trace        # momentum after one step: the gradients
    assert all(np.any(g != 0) for g in jax.tree.leaves(ref["grads"]))   # every parameter learns
    assert_tree_close(host(grads), ref["grads"], ref["grads"], "gradient", rtol=1e-5)
    params = nnx.state(model, nnx.Param)
    assert_tree_close(host(params), ref["params1"], ref["grads"], "updated param", rtol=1e-5,
                      ulps=2)
    check_shardings(mesh, params, grads)        # the step keeps every layout


def test_sharded_init_is_sharded_and_matches_eager(meshes):
    """create_train_state: parameters and Adam moments born sharded, values as eager init."""
    mesh = meshes["fsdp2_ep2_tp2"]
    layout = MeshLayout.of(mesh)
    cfg = VARIANTS["dag"]()
    model, optimizer = create_train_state(
        lambda: make_model(cfg, layout=layout), optax.adamw(1e-3), mesh)
    params = nnx.state(model, nnx.Param)
    adam = optimizer.opt_state[0]
    check_shardings(mesh, params, adam.mu, adam.nu)
    w = model.layers.block.experts.w_gate[...]
    assert w.sharding.spec == P(None, "expert", "fsdp", "tensor")
    assert {s.data.shape for s in w.addressable_shards} == {(2, N // 2, 16, 16)}
    assert optimizer.step[...].sharding.is_fully_replicated
    eager = host(nnx.state(make_model(cfg), nnx.Param))
    assert_tree_close(host(params), eager, eager, "init", rtol=1e-6)   # last-bit differences


def test_abstract_train_state_is_the_concrete_one_unmade(meshes):
    """create_train_state(abstract=True): the same variables, shapes, dtypes and shardings as
    the state made on the mesh, with no array made (what the ahead-of-time compile lowers)."""
    mesh = meshes["fsdp2_ep2_tp2"]
    layout = MeshLayout.of(mesh)
    cfg = VARIANTS["dag"]()
    made = create_train_state(lambda: make_model(cfg, layout=layout), optax.adamw(1e-3), mesh)
    unmade = create_train_state(lambda: make_model(cfg, layout=layout), optax.adamw(1e-3), mesh,
                                abstract=True)

    for real, abstract in zip(made, unmade):
        real = dict(jax.tree_util.tree_leaves_with_path(nnx.state(real)))
        abstract = dict(jax.tree_util.tree_leaves_with_path(nnx.state(abstract)))
        assert abstract.keys() == real.keys()
        for path, leaf in abstract.items():
            assert isinstance(leaf, jax.ShapeDtypeStruct), path
            assert (leaf.shape, leaf.dtype) == (real[path].shape, real[path].dtype), path
            assert leaf.sharding.is_equivalent_to(real[path].sharding, len(leaf.shape)), path


def test_expert_parallel_dispatch_uses_collectives(meshes):
    """Experts built with a mesh layout dispatch across devices (shard_map + all-to-all);
    without one the single-device code runs, mesh or not."""
    x = jnp.ones((16, 32))
    idx = jnp.tile(jnp.arange(2, dtype=jnp.int32), (16, 1))
    mesh = meshes["fsdp2_ep2_tp2"]
    texts = {}
    for mode in ("capacity", "dropless"):
        e_cfg = ExpertConfig(num_experts=N, expert_hidden=16, dispatch=mode, capacity_factor=2.0)
        sharded = Experts(e_cfg, 32, std=0.02, dtype=jnp.float32, layout=MeshLayout.of(mesh),
                          rngs=nnx.Rngs(0))
        local = Experts(e_cfg, 32, std=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))
        with activate(mesh):
            assert parallel_active()
            texts[mode] = str(jax.make_jaxpr(lambda x: sharded(x, idx))(x))
            assert "shard_map" not in str(jax.make_jaxpr(lambda x: local(x, idx))(x))
    assert not parallel_active()
    assert "all_to_all" in texts["capacity"] and "psum" in texts["capacity"]
    assert "all_gather" in texts["dropless"] and "reduce_scatter" in texts["dropless"]


@pytest.mark.parametrize("mesh_name", ["ep8", "dp2_ep4"])
def test_capacity_drops_per_device_group(meshes, mesh_name):
    """With drops, expert parallelism equals single-device capacity dispatch run on each
    device's tokens (its group) separately, and the dropped fraction counts those drops."""
    mesh = meshes[mesh_name]
    cfg = tiny_config("moe", "sum", experts=dict(num_experts=N, capacity_factor=0.5,
                                                  dispatch="capacity"),
                      router=dict(score_fn="softmax"))
    layout = MeshLayout.of(mesh)
    block = create_sharded(lambda: MoEBlock(cfg, tiny_execution(cfg, layout), layout,
                                            rngs=nnx.Rngs(1)), mesh)
    x = jax.random.normal(jax.random.key(0), (8, 16, 32)) * 3.0

    @nnx.jit
    def run(block, x):
        y, stats = block(BlockInputs(x))
        routing = block.router(x.reshape(-1, 32))
        return y, stats, routing.indices, routing.gates

    with activate(mesh):
        tokens = NamedSharding(mesh, P(("data", "fsdp", "expert")))
        y, stats, indices, gates = run(block, jax.device_put(x, tokens))
    e = block.experts
    weights = tuple(np.asarray(w[...]) for w in (e.w_gate, e.w_up, e.w_down))
    xt, indices, gates = np.asarray(x).reshape(-1, 32), np.asarray(indices), np.asarray(gates)
    outs, keeps = [], []
    for group in np.split(np.arange(xt.shape[0]), 8):       # device d holds tokens chunk d
        out, keep = capacity_dispatch(jnp.asarray(xt[group]), jnp.asarray(indices[group]),
                                      weights, 0.5)
        outs.append(np.einsum("tk,tkd->td", gates[group], np.asarray(out)))
        keeps.append(np.asarray(keep))
    keep = np.concatenate(keeps)
    assert 0.05 < 1 - keep.mean() < 0.95                      # really dropping, not everything
    np.testing.assert_allclose(float(stats.dropped_fraction), 1 - keep.mean(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 32), np.concatenate(outs),
                               rtol=1e-5, atol=1e-6)


def test_shard_batch(meshes):
    mesh = meshes["dp2_ep4"]
    batch = shard_batch(make_batch(), mesh)
    assert batch["inputs"].shape == (8, 8) and batch["mask"].dtype == bool
    assert batch["inputs"].sharding.spec == P(("data", "fsdp", "expert"), None)
    assert {s.data.shape for s in batch["targets"].addressable_shards} == {(1, 8)}
    np.testing.assert_array_equal(np.asarray(batch["targets"]), make_batch()["targets"])
    with pytest.raises(ValueError, match="do not divide"):
        shard_batch(make_batch(rows=4), mesh)


def test_mesh_config():
    assert MeshConfig().resolve(8) == (8, 1, 1, 1)
    assert MeshConfig(expert=4).resolve(8) == (2, 1, 4, 1)
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 1, 2)
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"^MeshConfig\.expert=.* is invalid: expected"):
            MeshConfig(expert=bad)
    with pytest.raises(ValueError, match="at most one size of -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match=r"MeshConfig\(data=3, fsdp=1, expert=1, tensor=1\) does "
                                         r"not fit 8 devices"):
        make_mesh(MeshConfig(data=3))
    with pytest.raises(ValueError, match="expert=3.*does not fit 8 devices"):
        make_mesh(MeshConfig(expert=3))


@pytest.mark.parametrize("mode", ["capacity", "dropless"])
def test_token_count_the_mesh_does_not_divide_falls_back(meshes, mode):
    """6 tokens on 4 token shards (e.g. sampling one sequence): the global-view dispatch runs,
    partitioned by XLA, and gives the single-device result."""
    x = jax.random.normal(jax.random.key(1), (6, 32))
    idx = jnp.stack([jnp.arange(6) % N, (jnp.arange(6) + 3) % N], axis=1).astype(jnp.int32)
    mesh = meshes["fsdp2_ep2_tp2"]
    e_cfg = ExpertConfig(num_experts=N, expert_hidden=16, dispatch=mode, capacity_factor=2.0)
    local = Experts(e_cfg, 32, std=0.2, dtype=jnp.float32, rngs=nnx.Rngs(0))
    expected = np.asarray(local(x, idx)[0])
    experts = Experts(e_cfg, 32, std=0.2, dtype=jnp.float32, layout=MeshLayout.of(mesh),
                      rngs=nnx.Rngs(0))                               # the same weights
    place_on_mesh(experts, mesh)
    with activate(mesh):
        out = nnx.jit(lambda e, x: e(x, idx)[0])(experts, x)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


def test_indivisible_experts_are_a_clear_error(meshes):
    experts = Experts(ExpertConfig(num_experts=4, expert_hidden=16, dispatch="capacity",
                                   capacity_factor=1.0), 32, std=0.02, dtype=jnp.float32,
                      layout=MeshLayout.of(meshes["ep8"]), rngs=nnx.Rngs(0))   # 4 on 8 shards
    idx = jnp.zeros((16, 2), jnp.int32)
    with activate(meshes["ep8"]), pytest.raises(ValueError, match="experts N=4 is not divisible"):
        jax.eval_shape(lambda x: experts(x, idx), jnp.ones((16, 32)))
