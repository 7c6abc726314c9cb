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
    from dagmoe_jax.compile.programs import compile_run
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    chip, devices = topology_devices(gpu)
    experts, hidden, rows, seq, top_k = 8, 128, 4, 128, 2
    cfg = tiny_config(d_model=128, num_heads=4, num_kv_heads=2, max_seq_len=256,
                      compute_dtype="bfloat16", aggregation=dict(kind="dag", dag_dim=64),
                      experts=dict(num_experts=experts, expert_hidden=hidden),
                      router=dict(top_k=top_k))
    settled, reports = compile_run(cfg, DataConfig(batch_size=rows, seq_len=seq), OptimConfig(),
                                   RunConfig(execution=ExecutionConfig(dag_module="triton")),
                                   make_mesh(MeshConfig(data=1), devices), chip,
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
    # what ptxas made of them (compile/ptxas.py): the DAG kernels' registers, their 8 warps
    assert train.pallas_kernels["dagmoe_triton_dag_forward"] == 256
    for name in ("dagmoe_triton_dag_forward", "dagmoe_triton_dag_backward"):
        resources = train.kernel_resources[name]
        assert 0 < resources.registers <= 255
        assert 1 <= resources.blocks_per_sm(256) <= 8
    assert len(train.kernel_resources) > len(train.pallas_kernels)      # XLA's own kernels too


PTXAS_LOG = """ptx: .visible .entry dagmoe_triton_dag_forward(
ptx: .maxntid 256, 1, 1
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dagmoe_triton_dag_forward' for 'sm_90a'
ptxas info    : Function properties for dagmoe_triton_dag_forward
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compile time = 387.681 ms
ptxas warning : Registers are spilled to local memory in function 'loop_fusion', 632 bytes spill stores, 632 bytes spill loads
ptxas info    : Compiling entry function 'loop_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_fusion
    560 bytes stack frame, 632 bytes spill stores, 640 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 560 bytes cumulative stack size
"""


def test_ptxas_resources_are_read_and_give_the_blocks_an_sm_holds():
    from dagmoe_jax.compile.ptxas import KernelResources, parse
    kernels = parse(PTXAS_LOG)
    assert kernels == {
        "dagmoe_triton_dag_forward": KernelResources(registers=255, threads=256),
        "loop_fusion": KernelResources(registers=40, spill_stores=632, spill_loads=640)}
    forward = kernels["dagmoe_triton_dag_forward"]
    # 255 registers -> 256 a thread, 8192 a warp: 8 warps an SM, one block of 8 warps
    assert forward.blocks_per_sm() == 1 and forward.resident_warps() == 8
    assert "1 blocks an SM (8 of 64 warps), no spills" in forward.describe()
    # 40 -> 1280 a warp: 51 warps; blocks of 4 warps: 12 (48 warps); of one warp: 32 at most
    assert kernels["loop_fusion"].blocks_per_sm(128) == 12
    assert kernels["loop_fusion"].blocks_per_sm(32) == 32
    assert kernels["loop_fusion"].blocks_per_sm() is None
    assert "632 B spilled" in kernels["loop_fusion"].describe(128)


@needs_gpu_compiler
def test_the_recording_ptxas_passes_on_what_ptxas_says_without_v(tmp_path):
    """The PATH's ptxas (compile/ptxas.py) assembles as the real one does, prints what it
    prints without -v, and records the entry's resources and threads."""
    import subprocess
    from dagmoe_jax.compile import ptxas
    from dagmoe_jax.compile.chips import ptxas_path
    real = ptxas_path()
    wrapper = ptxas.install(real) / "ptxas"
    kernel = tmp_path / "k.ptx"
    kernel.write_text(".version 8.0\n.target sm_80\n.address_size 64\n"
                      ".visible .entry tiny(\n.param .u64 p\n)\n.maxntid 64, 1, 1\n"
                      "{\nret;\n}\n")
    plain = subprocess.run([real, str(kernel), "-o", str(tmp_path / "a.o"), "-arch=sm_80"],
                           capture_output=True, text=True)
    with ptxas.recorded() as kernels:
        ours = subprocess.run([str(wrapper), str(kernel), "-o", str(tmp_path / "b.o"),
                               "-arch=sm_80"], capture_output=True, text=True)
    assert ours.returncode == plain.returncode == 0
    assert (ours.stdout, ours.stderr) == (plain.stdout, plain.stderr)
    assert (tmp_path / "a.o").read_bytes() == (tmp_path / "b.o").read_bytes()
    # what it records is what ptxas -v itself reports for the entry
    verbose = subprocess.run([real, "-v", str(kernel), "-o", str(tmp_path / "c.o"),
                              "-arch=sm_80"], capture_output=True, text=True)
    used = re.search(r"Used (\d+) registers", verbose.stdout + verbose.stderr)
    assert used, verbose.stderr
    assert kernels["tiny"].threads == 64
    assert kernels["tiny"].registers == int(used.group(1)) > 0
    assert kernels["tiny"].spill_stores == 0


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
    # XLA's DAG module in d_g ('auto' on a GPU; the Triton kernels ran 3.3x slower than XLA
    # on an H200), with the evidence it was chosen on
    assert "DAG module bottleneck (XLA's in the bottleneck space" in out, out
    assert "triton dag" not in out
    # what ptxas made of the kernels: the attention's by name, the grouped matmuls' Mosaic ones
    assert re.search(r"ptxas, mha_forward: \d+ registers x \d+ threads: \d+ blocks an SM", out)
    assert re.search(r"ptxas, body_mosaic_gpu_kernel\S*: \d+ registers", out), out
    assert re.search(r"ptxas, XLA's \d+ kernels: ", out)


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
