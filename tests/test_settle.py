"""Every machine-dependent choice is settled once, before the model is built
(dagmoe_jax.model.settle), and the model code never asks what machine it runs on."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.model import Transformer
from dagmoe_jax.parallel import MeshConfig, make_mesh
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.model.settle import describe, settle

PACKAGE = Path(__file__).resolve().parent.parent / "dagmoe_jax"


def test_settle_decides_every_auto_field_per_backend_and_layout():
    cfg = tiny_config()
    assert set(ExecutionConfig().unsettled) == {"remat", "scan_unroll", "attention",
                                                "grouped_matmul", "expert_exchange",
                                                "fuse_projections", "dag_module",
                                                "loss_chunk"}
    ex = settle(cfg, backend="cpu")
    assert ex.unsettled == ()
    assert (ex.remat, ex.scan_unroll, ex.attention, ex.fuse_projections) == (
        "none", cfg.num_layers, "fused", True)
    # the CPU grouped matmul kernel (it builds wherever the fused attention kernel does, which
    # the line above asserts)
    assert ex.grouped_matmul == "cpu_gmm"
    assert "dispatch dropless" in describe(cfg, ex, ExecutionConfig(), "cpu")
    assert ex.loss_chunk == 512 and settle(cfg, backend="tpu").loss_chunk == 4096
    gpu = settle(cfg.replace(compute_dtype="bfloat16"), backend="gpu")
    assert (gpu.remat, gpu.scan_unroll, gpu.attention) == ("full", 1, "cudnn")
    assert settle(cfg, backend="tpu").attention == "splash"
    # what the experts compute is architecture (the model config, unchanged); only how it runs
    assert gpu.grouped_matmul == "ragged_dot"
    assert settle(cfg, backend="tpu").grouped_matmul == "ragged_dot"  # d 32: no tile
    tpu = settle(cfg.replace(d_model=128, block=dict(experts=dict(expert_hidden=128))),
                 backend="tpu")
    assert tpu.grouped_matmul == "gmm"
    layout = MeshLayout.of(make_mesh(MeshConfig(data=2), jax.devices()[:2]))
    meshed = settle(cfg, backend="cpu", layout=layout)
    assert (meshed.attention, meshed.fuse_projections, meshed.grouped_matmul) == (
        "blockwise", False, "ragged_dot")
    line = describe(cfg, meshed, None, "cpu", layout)
    assert "mesh {'data': 2" in line and "no expert axis" in line and "expert-parallel" not in line
    expert_layout = MeshLayout.of(make_mesh(MeshConfig(expert=2), jax.devices()[:2]))
    assert "expert-parallel over {" in describe(cfg, settle(cfg, backend="cpu",
                                                            layout=expert_layout),
                                                None, "cpu", expert_layout)
    # what the user set explicitly is kept
    explicit = ExecutionConfig(remat="dots", scan_unroll=2, attention="xla",
                               fuse_projections=False, grouped_matmul="gmm",
                               expert_exchange="ragged_all_to_all", dag_module="xla",
                               loss_chunk=1024)
    assert settle(cfg, explicit, backend="cpu") == explicit
    assert settle(cfg, ex, backend="cpu") == ex                  # idempotent
    assert MeshLayout.of(make_mesh(MeshConfig(data=1), jax.devices()[:1])) is None


def test_the_dag_module_runs_in_the_cpu_kernels_only_where_they_can():
    """'auto' is the C++ kernel for a DAG model on one CPU device in float32 with d_g a multiple
    of 16, XLA's rows elsewhere on CPU; XLA's program in d_g on a GPU; XLA's with the node axis
    kept on TPU, whatever the widths (the Mosaic kernels only when asked for: no TPU has
    measured them); an explicit 'fused' under a mesh is one line. The printed line says on
    what evidence an 'auto' one was chosen."""
    from dagmoe_jax.model.settle import DAG_EVIDENCE
    dag = tiny_config("moe", "dag", aggregation=dict(dag_dim=16))
    assert settle(dag, backend="cpu").dag_module == "fused"
    assert "DAG module fused" in describe(dag, settle(dag, backend="cpu"), None, "cpu")
    line = describe(dag, settle(dag, backend="cpu"), ExecutionConfig(), "cpu")
    assert f"DAG module fused ({DAG_EVIDENCE['fused']})" in line, line
    assert "DAG module" not in describe(tiny_config(), settle(tiny_config(), backend="cpu"),
                                          None, "cpu")
    for other in (dag.replace(block=dict(aggregation=dict(dag_dim=12))),
                  dag.replace(compute_dtype="bfloat16"), tiny_config("moe", "sum")):
        assert settle(other, backend="cpu").dag_module == "xla"
    assert settle(dag, backend="gpu").dag_module == "bottleneck"
    line = describe(dag, settle(dag, backend="gpu"), ExecutionConfig(), "gpu")
    assert "DAG module bottleneck (XLA's in the bottleneck space" in line, line
    wide = tiny_config("moe", "dag", d_model=128, num_heads=4, num_kv_heads=2,
                       aggregation=dict(dag_dim=128))
    for cfg in (dag, wide):                    # 'pallas' could take the second: not 'auto'
        assert settle(cfg, backend="tpu").dag_module == "xla_rank3"
    assert settle(wide, ExecutionConfig(dag_module="pallas"), backend="tpu").dag_module == \
        "pallas"
    assert describe(dag, settle(dag, ExecutionConfig(dag_module="xla"), backend="gpu"),
                    ExecutionConfig(dag_module="xla"), "gpu").endswith("DAG module xla")
    assert settle(tiny_config(), backend="tpu").dag_module == "xla"   # no DAG module
    layout = MeshLayout.of(make_mesh(MeshConfig(data=2), jax.devices()[:2]))
    assert settle(dag, backend="cpu", layout=layout).dag_module == "xla"
    with pytest.raises(ValueError, match=r"^ExecutionConfig.dag_module='fused' runs on a "
                                         r"single device only; use 'auto' or 'xla' under a "
                                         r"device mesh$"):
        settle(dag, ExecutionConfig(dag_module="fused"), backend="cpu", layout=layout)
    for explicit in ("xla", "xla_rank3", "bottleneck"):
        assert settle(dag, ExecutionConfig(dag_module=explicit), backend="cpu").dag_module == \
            explicit


def test_tpu_sizes_the_grouped_matmul_by_the_family_that_runs_it():
    """megablox gmm takes 128-multiple widths only: DoE's knowledge blocks run their grouped
    matmul at h_b, so h_b (not the missing experts' d_r, nor d_model) decides."""
    def doe(block_hidden):
        return tiny_config("doe", d_model=128, num_heads=4, num_kv_heads=2,
                           doe=dict(expert="blocks", num_topics=4, block_hidden=block_hidden))
    assert settle(doe(128), backend="tpu").grouped_matmul == "gmm"
    assert settle(doe(100), backend="tpu").grouped_matmul == "ragged_dot"


def test_a_model_built_without_a_settled_execution_settles_it_itself():
    """``Transformer(cfg, rngs=...)`` (no execution, or one with 'auto's left) settles what is
    left for this machine, as the run does; a concrete choice is kept."""
    cfg = tiny_config()
    settled = settle(cfg)
    assert not settled.unsettled
    assert Transformer(cfg, rngs=nnx.Rngs(0)).execution == settled
    assert Transformer(cfg, execution=ExecutionConfig(), rngs=nnx.Rngs(0)).execution == settled
    chosen = Transformer(cfg, execution=ExecutionConfig(remat="full"), rngs=nnx.Rngs(0))
    assert chosen.execution == dataclasses.replace(settled, remat="full")


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_gate_up_fusion_is_the_same_function(dispatch):
    """fuse_projections ([W_gate | W_up] in the SwiGLUs, [W_q | W_k | W_v] in attention) changes
    neither the outputs nor the gradients beyond rounding."""
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 64)
    cfg = tiny_config("moe", "sum", experts=dict(num_shared=1, dispatch=dispatch,
                                                 capacity_factor=4.0))
    fused, plain = make_model(cfg), make_model(cfg, fuse_projections=False)
    assert fused.execution.fuse_projections and not plain.execution.fuse_projections
    forward = nnx.jit(lambda m: m(tokens)[0])     # jitted: op by op the test took 1.6x as long
    a, b = forward(fused), forward(plain)
    assert float(jnp.max(jnp.abs(a - b))) < 1e-5 * float(jnp.max(jnp.abs(a)))
    grad = nnx.jit(nnx.grad(lambda m: jnp.mean(m(tokens)[0] ** 2)))
    ga, gb = grad(fused), grad(plain)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        assert float(jnp.max(jnp.abs(x - y))) <= 1e-5 * float(jnp.max(jnp.abs(x))) + 1e-9


def _sources(folder: str):
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        yield path, path.read_text()


def test_model_code_never_asks_what_machine_it_runs_on():
    """Only ``model/settle.py`` asks (the one place every 'auto' is decided); the modules that
    compute read its answer from their ``ExecutionConfig``."""
    sources = list(_sources("model"))
    assert "settle.py" in {path.name for path, _ in sources}
    for path, text in sources:
        if path.name == "settle.py":
            continue
        for needle in ("default_backend", "get_abstract_mesh", "parallel_active", "get_mesh",
                       "jax.devices"):
            assert needle not in text, f"{path.name} uses {needle}"


def test_parallel_imports_nothing_from_model():
    for path, text in _sources("parallel"):
        for node in ast.walk(ast.parse(text)):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.startswith("dagmoe_jax.model") for n in names), path.name
