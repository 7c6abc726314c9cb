"""The GPU path through the real GPU compiler (XLA:GPU from the CUDA plugin wheels that
``.ci/run`` installs without their nvidia-* dependencies, and CUDA's ``ptxas``): training steps
compiled for an H100 and an A100 on this CPU, with nothing materialised
(``dagmoe_jax.compile --topology h100``). 'auto' settles the grouped matmuls to the Mosaic GPU
kernels on the H100 and to the Triton kernel on the A100, and the DAG module to its Triton
kernels on both; the compiled step holds them as custom calls and no buffer of the dense
rewrite XLA:GPU makes of ``ragged_dot``.
"""

from __future__ import annotations

import re

import jax
import pytest

from conftest import tiny_config
from dagmoe_jax.compile.chips import CHIPS, gpu_compiler_missing, parse_topology
from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.data import DataConfig
from dagmoe_jax.run.config import OptimConfig, RunConfig

MISSING = gpu_compiler_missing()
needs_gpu_compiler = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


@pytest.fixture(autouse=True)
def default_precision():
    """The conftest's 'highest' matmul precision off, as a GPU run has it."""
    with jax.default_matmul_precision("default"):
        yield


def array_shapes(hlo: str):
    """Every array shape of an HLO module's text, as int tuples."""
    return {tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"\b(?:bf16|f32|f16)\[([0-9,]+)\]", hlo)}


def test_gpu_topologies_parse():
    assert parse_topology("h100") == (CHIPS["h100"], (1,))
    assert parse_topology("h100:8") == (CHIPS["h100"], (8,))
    assert parse_topology("a100")[0].sm_count == 108
    with pytest.raises(ValueError, match="1 to 8 GPUs"):
        parse_topology("h100:16")
    with pytest.raises(ValueError, match="h100"):
        parse_topology("b300")


@needs_gpu_compiler
def test_dropless_step_compiles_with_the_triton_kernel_for_a100():
    gpu, kernel = "a100", "triton"
    from dagmoe_jax.compile.chips import topology_devices
    from dagmoe_jax.compile.programs import compile_run, mesh_over
    chip, devices = topology_devices(gpu)
    experts, hidden, rows, seq, top_k = 8, 128, 4, 128, 2
    cfg = tiny_config(d_model=128, num_heads=4, num_kv_heads=2, max_seq_len=256,
                      compute_dtype="bfloat16", aggregation=dict(kind="dag", dag_dim=64),
                      experts=dict(num_experts=experts, expert_hidden=hidden),
                      router=dict(top_k=top_k))
    settled, reports = compile_run(cfg, DataConfig(batch_size=rows, seq_len=seq), OptimConfig(),
                                   RunConfig(execution=ExecutionConfig(dag_module="triton")),
                                   mesh_over(devices, dict(data=1)), chip,
                                   programs=("train",), keep_hlo=True)
    assert settled.grouped_matmul == kernel
    assert settled.dag_module == "triton"    # asked for ('auto' is XLA's); d_g 64, K 2: taken
    train = reports["train"]
    kernels = train.cost.kernels
    # each layer's L = 2 iterations: the forward kernel (again in the backward pass, which
    # recomputes the layer) and the backward kernel
    assert kernels.get("triton dag forward", 0) >= 2 * 2, kernels
    assert kernels.get("triton dag backward", 0) == 2 * 2, kernels
    # each layer: gate, up and down forward, their input and weight gradients (remat full on
    # GPU recomputes the forward too); the scanned layer body is counted per layer
    assert kernels.get(f"{kernel} gmm", 0) >= 2 * 6, kernels
    assert kernels.get(f"{kernel} tgmm", 0) >= 2 * 3, kernels
    assert 0 < train.total_bytes < chip.hbm_bytes
    assert train.cost.seconds > 0 and train.cost.matmul_flops >= train.model_flops * 0.9
    # the dense rewrite of ragged_dot: a [experts, rows, hidden] buffer
    rows_k = rows * seq * top_k
    dense = {s for s in array_shapes(train.hlo) if s[:2] == (experts, rows_k)}
    assert not dense, dense


@needs_gpu_compiler
@pytest.mark.slow
def test_compile_command_reports_an_h100(capsys):
    """``dagmoe-compile --topology h100`` on DAG-MoE-s (its layers, a smaller batch and
    vocabulary to keep the suite short): the Mosaic GPU kernels settled and compiled, per-GPU
    memory against the card's, and an MFU estimate. (The A100's Triton kernels: above; the
    command is the same code for both.)"""
    gpu, kernel = "h100", "mgpu"
    from dagmoe_jax.compile.__main__ import main
    code = main(["--gin_file=models/s.gin", "--gin_file=variants/dag_g128_l2.gin",
                 "--gin.ModelConfig.compute_dtype='bfloat16'",
                 "--gin.ModelConfig.vocab_size=4096", "--gin.DataConfig.batch_size=4",
                 "--gin.DataConfig.seq_len=512", f"--topology={gpu}", "--programs=train"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"grouped matmul {kernel}" in out and "DAG module" in out
    assert re.search(rf"of {CHIPS[gpu].hbm_bytes / 1e9:.2f} GB HBM", out), out
    assert f"{kernel} gmm" in out and f"{kernel} tgmm" in out
    assert re.search(r"MFU \d+\.\d%", out), out
    assert re.search(r"DAG module: [\d.]+ ms of the estimate .* \d+ kernel launches", out), out
    assert "attention compiled as the Pallas Triton flash kernel's in cuDNN's place" in out
    assert "attention triton" in out
    # XLA's DAG module ('auto' on a GPU: 3.3x faster than the Triton kernels on an H200)
    assert "DAG module xla" in out and "triton dag" not in out


SCOPED_HLO = """HloModule scoped, entry_computation_layout={()->f32[]}

%fused_norm (p0: f32[1024,256]) -> f32[1024,256] {
  %p0 = f32[1024,256]{1,0} parameter(0)
  ROOT %neg = f32[1024,256]{1,0} negate(%p0), metadata={op_name="jit(step)/jvp()/dag_module/sub"}
}

ENTRY %main (x: f32[1024,256], w: f32[256,256]) -> f32[1024,256] {
  %x = f32[1024,256]{1,0} parameter(0)
  %w = f32[256,256]{1,0} parameter(1)
  %norm = f32[1024,256]{1,0} fusion(%x), kind=kLoop, calls=%fused_norm
  %proj = f32[1024,256]{1,0} dot(%norm, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/dag_module/dot_general"}
  ROOT %out = f32[1024,256]{1,0} dot(%proj, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/dot_general"}
}
"""


DISPATCH_HLO = """HloModule dispatch, entry_computation_layout={()->f32[]}

%fused_silu (p0: f32[1024,256]) -> f32[1024,256] {
  %p0 = f32[1024,256]{1,0} parameter(0)
  ROOT %neg = f32[1024,256]{1,0} negate(%p0), metadata={op_name="jit(step)/jvp()/moe_dispatch/expert_ffn/logistic"}
}

ENTRY %main (x: f32[1024,256], w: f32[256,256]) -> f32[1024,256] {
  %x = f32[1024,256]{1,0} parameter(0)
  %w = f32[256,256]{1,0} parameter(1)
  %rows = f32[1024,256]{1,0} copy(%x), metadata={op_name="jit(step)/transpose(jvp(moe_dispatch))/gather"}
  %sent = f32[1024,256]{1,0} all-to-all(%rows), replica_groups={{0,1}}, dimensions={0}, metadata={op_name="jit(step)/jvp()/moe_dispatch/all_to_all"}
  %h = f32[1024,256]{1,0} dot(%sent, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/moe_dispatch/pallas_call"}
  %act = f32[1024,256]{1,0} fusion(%h), kind=kLoop, calls=%fused_silu, metadata={op_name="jit(step)/jvp()/moe_dispatch/expert_ffn/mul"}
  ROOT %out = f32[1024,256]{1,0} copy(%act), metadata={op_name="jit(step)/jvp()/moe_dispatch_other/copy"}
}
"""


def test_the_dispatch_is_its_scope_less_the_experts_products():
    """The dispatch's cost counts the gather (its scope wrapped by a derivative's name) and
    the collective, and leaves out the experts' SwiGLU (its own scope), the product (a kernel
    whose custom VJP loses the scope's name is left out by its FLOPs) and a scope that merely
    starts with the same letters."""
    from dagmoe_jax.compile.roofline import program_cost
    from dagmoe_jax.compile.scopes import dispatch_cost, has_scope
    chip = CHIPS["h100"]
    part, whole = dispatch_cost(DISPATCH_HLO, chip, 2), program_cost(DISPATCH_HLO, chip, 2)
    rows = 1024 * 256 * 4
    assert part.launches == 2 and part.matmul_flops == 0
    assert part.hbm_bytes == 2 * rows                          # the copy's read and write
    assert part.seconds == pytest.approx(2 * rows / chip.hbm_bandwidth)
    assert part.collective_seconds == whole.collective_seconds > 0
    assert has_scope(DISPATCH_HLO, "moe_dispatch") and not has_scope(DISPATCH_HLO, "dispatch")


def test_scope_cost_counts_the_dag_modules_instructions():
    """The fusion whose fused instruction carries the scope and the scoped dot are the
    module's; the last dot is not."""
    from dagmoe_jax.compile.roofline import program_cost
    from dagmoe_jax.compile.scopes import scope_cost
    chip = CHIPS["h100"]
    part, whole = scope_cost(SCOPED_HLO, chip), program_cost(SCOPED_HLO, chip, 1)
    rows = 1024 * 256 * 4
    assert part.launches == 2
    assert part.matmul_flops == 2 * 1024 * 256 * 256 == whole.matmul_flops / 2
    assert part.hbm_bytes == 2 * rows + (2 * rows + 256 * 256 * 4)     # fusion; dot's io
    assert 0 < part.seconds < whole.compute_seconds
    assert part.at_peak(chip) == part.matmul_flops / chip.peak_flops
    assert scope_cost(SCOPED_HLO, chip, "moe").launches == 0
