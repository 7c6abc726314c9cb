"""The jitted training step of an accelerator config lowers for TPU and CUDA on this CPU machine
(``jax.export``), so a CPU-only code path in an accelerator configuration fails the suite.

The config is settled for the target backend as a run there would be (bfloat16 compute, remat
'full', one scanned layer body, dropless dispatch, the DAG aggregator, the tiled loss): on TPU
the Pallas splash attention and megablox gmm, which must appear in the lowered module as Mosaic
custom calls; on CUDA ``ragged_dot``. Under a data x expert mesh of 4 of the simulated CPU
devices the expert-parallel dispatch (``ragged_all_to_all``, which XLA:CPU could not run) and
the splash kernel's ``shard_map`` lower too.

One substitution: on CUDA, attention is lowered as 'xla' rather than the settled 'cudnn',
because JAX's cuDNN attention checks the installed cuDNN library's version while lowering
("cuDNN is not detected" without the GPU's libraries); everything else is lowered as settled.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import tiny_config
from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.model import Transformer
from dagmoe_jax.parallel import MeshConfig, activate, make_mesh
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.model.settle import settle
from dagmoe_jax.train.step import make_train_step

BACKEND = {"tpu": "tpu", "cuda": "gpu"}


def lower_train_step(platform: str, mesh_cfg=None, exchange_buffer=None) -> tuple:
    """(settled execution config, lowered StableHLO text) of the training step for
    ``platform``."""
    cfg = tiny_config(d_model=128, num_heads=4, num_kv_heads=2, max_seq_len=128,
                      compute_dtype="bfloat16", aggregation=dict(kind="dag"),
                      experts=dict(expert_hidden=128, dispatch="dropless",
                                   exchange_buffer=exchange_buffer))
    mesh = make_mesh(mesh_cfg, jax.devices()[:4]) if mesh_cfg else None
    layout = MeshLayout.of(mesh)
    execution = settle(cfg, ExecutionConfig(attention="xla" if platform == "cuda" else "auto"),
                       backend=BACKEND[platform], layout=layout)

    def build():
        model = Transformer(cfg, execution=execution, rngs=nnx.Rngs(0), layout=layout)
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    graphdef, state = nnx.split(nnx.eval_shape(build))
    step = make_train_step()

    @jax.jit
    def pure_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = step(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    rows = NamedSharding(mesh, P(("data", "expert"))) if mesh else None
    tokens = jax.ShapeDtypeStruct((4, 128), jnp.int32, sharding=rows)
    batch = {"inputs": tokens, "targets": tokens}
    # ragged_all_to_all lowers to a custom call that jax.export does not promise to keep
    # compatible across versions; this test checks that it lowers, not that it serialises
    lower = export.export(pure_step, platforms=(platform,), disabled_checks=[
        export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])
    if mesh is None:
        return execution, lower(state, batch).mlir_module()
    with activate(mesh):
        return execution, lower(state, batch).mlir_module()


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("mesh", [None, MeshConfig(data=2, expert=2)], ids=["one", "mesh"])
def test_train_step_lowers_for_accelerators(platform, mesh):
    ex, module = lower_train_step(platform, mesh)
    assert (ex.remat, ex.scan_unroll) == ("full", 1)
    assert "bf16" in module
    if platform == "tpu":
        assert (ex.attention, ex.grouped_matmul) == ("splash", "gmm")
        # the two Pallas kernels, forward and backward, lowered for Mosaic
        assert module.count("tpu_custom_call") >= 4
        # splash attention's own kernels (gmm alone makes more than 4 custom calls, so a
        # silent fallback to XLA attention would pass the count)
        kernels = set(re.findall(r'kernel_name\s*=\s*"([^"]+)"', module))
        for part in ("fwd", "dq", "dkv"):
            assert any(k.startswith(f"splash_mha_{part}") for k in kernels), (part, kernels)
    else:
        assert (ex.attention, ex.grouped_matmul) == ("xla", "ragged_dot")
        assert "ragged_dot" in module and "tpu_custom_call" not in module
    if mesh is not None:
        # expert-parallel dropless dispatch by the ragged collective (CPU has the all-gather)
        assert ex.expert_exchange == "ragged_all_to_all"
        assert module.count("ragged_all_to_all") >= 4              # forward 2, backward 2


def test_a_bounded_exchange_buffer_lowers_with_buffers_of_its_size():
    """ExpertConfig.exchange_buffer = 1 on data 2 x expert 2 (T_loc 128 tokens, K 2): the ragged
    exchange's receive buffers hold the balanced 256 rows, not the worst case's E x 256 = 512
    (the unbounded lowering's), forward and backward. On TPU rows move in blocks of 16
    (bfloat16's tile), each sender's slice padded to whole blocks: the receive buffer is the
    256 rows and a block per sender, rounded up to gmm's 128-row tile, 384 rows = 24 blocks;
    what comes back lands in the sender's 256 rows and a block per receiver, 18 blocks."""
    _, module = lower_train_step("tpu", MeshConfig(data=2, expert=2), exchange_buffer=1.0)
    calls = [line for line in module.splitlines()
             if "ragged_all_to_all" in line and "custom_call" in line]
    assert len(calls) >= 4
    results = {re.search(r"-> (tensor<[^>]*>)", line).group(1) for line in calls}
    assert results == {"tensor<24x16x128xbf16>", "tensor<18x16x128xbf16>"}, results
