"""The pod path through the real TPU compiler (XLA:TPU and Mosaic, from the ``libtpu`` wheel that
``.ci/run`` installs): the run's programs compiled for a v5p slice on this CPU, with nothing
materialised (``dagmoe_jax.compile``).

The suite's conftest sets ``jax_default_matmul_precision='highest'``, under which every Mosaic
kernel fails to compile ("Bad lhs type"): these compilations run at the default precision, and
settling the kernels under 'highest' is a one-line refusal (checked here).
The roofline's HLO reading is checked on a hand-written module whose costs are known.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from conftest import tiny_config
from dagmoe_jax.compile import kernel_costs, roofline
from dagmoe_jax.compile.chips import CHIPS, parse_topology, tpu_compiler_missing
from dagmoe_jax.data import DataConfig
from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.run.config import OptimConfig, RunConfig

@pytest.fixture(autouse=True)
def default_precision():
    """The conftest's 'highest' matmul precision off: the Pallas TPU kernels compile at the
    default precision only (building refuses them otherwise: checked below)."""
    with jax.default_matmul_precision("default"):
        yield


needs_tpu_compiler = pytest.mark.skipif(
    tpu_compiler_missing() is not None,
    reason="libtpu is not installed (pip install 'jax[tpu]==<jax>'; .ci/run installs it)")


def small_dag(aggregation=None, **overrides):
    """A DAG-MoE whose dims take the Pallas kernels' 128 tiles (gmm) and splash's blocks."""
    return tiny_config(d_model=128, num_heads=4, num_kv_heads=2, max_seq_len=256,
                       compute_dtype="bfloat16",
                       aggregation=dict(kind="dag", **(aggregation or {})),
                       experts=dict(expert_hidden=128), **overrides)


@pytest.fixture(scope="module")
def v5p():
    from dagmoe_jax.compile.chips import topology_devices
    return topology_devices("v5p:2x2x1")


def pallas_dag():
    """:func:`small_dag` at d_g 128, the Mosaic DAG kernels' tile."""
    return small_dag(aggregation=dict(dag_dim=128))


@pytest.fixture(scope="module")
def mesh_step(v5p):
    """(mesh, settled execution, training-step report) of :func:`pallas_dag` compiled with
    'auto' but the DAG module's Mosaic kernels ('pallas': asked for, 'auto' being XLA's) on
    the v5p-8 as data=2 x expert=2, the HLO kept: one compilation that two tests read."""
    from dagmoe_jax.compile.programs import compile_run
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    chip, devices = v5p
    mesh = make_mesh(MeshConfig(data=2, expert=2), devices)
    with jax.default_matmul_precision("default"):     # a module fixture: before the autouse one
        settled, reports = compile_run(pallas_dag(), DataConfig(batch_size=8, seq_len=128),
                                       OptimConfig(),
                                       RunConfig(execution=ExecutionConfig(dag_module="pallas")),
                                       mesh, chip, programs=("train",), keep_hlo=True)
    return mesh, settled, reports["train"]


def tiny_step_has_the_kernels(settled, train, chip) -> None:
    """Splash attention and the megablox grouped matmuls settled, and their Mosaic kernels,
    forward and backward, in the compiled step (2 layers, remat full), which fits the chip."""
    assert (settled.attention, settled.grouped_matmul) == ("splash", "gmm")
    kernels = train.cost.kernels
    for name in ("gmm", "tgmm", "splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"):
        assert kernels.get(name, 0) >= 2, (name, kernels)
    assert 0 < train.total_bytes < chip.hbm_bytes
    assert train.cost.seconds > 0 and train.cost.matmul_flops >= train.model_flops


@needs_tpu_compiler
def test_tiny_dag_compiles_for_v5p_on_one_chip(v5p):
    from dagmoe_jax.compile.programs import compile_run
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    chip, devices = v5p
    mesh = make_mesh(MeshConfig(data=1), devices[:1])
    settled, reports = compile_run(small_dag(), DataConfig(batch_size=8, seq_len=128),
                                   OptimConfig(), RunConfig(), mesh, chip,
                                   programs=("train",), keep_hlo=True)
    train = reports["train"]
    tiny_step_has_the_kernels(settled, train, chip)
    assert not train.cost.collectives
    dag_module_keeps_its_node_axis_on_tpu(settled, train.cost, chip, mesh)


@needs_tpu_compiler
def test_tiny_dag_compiles_for_v5p_under_data_x_expert(v5p, mesh_step):
    """Expert-parallel dispatch by the ragged all-to-all, gradients all-reduced, each routed
    expert weight one chip's shard."""
    mesh, settled, train = mesh_step
    tiny_step_has_the_kernels(settled, train, v5p[0])
    collectives = train.cost.collectives
    assert collectives["ragged-all-to-all"]["count"] >= 4
    assert collectives["all-reduce"]["bytes"] > 0
    expert_weights_sharded_by_the_rules(train.hlo, pallas_dag(), mesh)


@needs_tpu_compiler
def test_the_dag_kernels_compile_for_v5p_and_move_fewer_bytes(v5p, mesh_step):
    """The DAG module's Mosaic kernels ('pallas', d and d_g multiples of 128; asked for),
    here inside a data x expert mesh's shard_map (one chip runs the same kernels
    without it; the interpreted tests check both): the compiled training step runs
    each iteration's forward and backward kernel, and moves fewer HBM bytes than the same
    step with XLA's rank-3 module (its own instructions under half the bytes), whose matmul
    FLOPs its cost estimates match to 10%."""
    from dagmoe_jax.compile.programs import compile_run
    chip = v5p[0]
    mesh, settled, train = mesh_step
    costs, modules = {settled.dag_module: train.cost}, {settled.dag_module: train.dag_module}
    settled, reports = compile_run(
        pallas_dag(), DataConfig(batch_size=8, seq_len=128), OptimConfig(),
        RunConfig(execution=ExecutionConfig(dag_module="xla_rank3")), mesh, chip,
        programs=("train",))
    costs[settled.dag_module] = reports["train"].cost
    modules[settled.dag_module] = reports["train"].dag_module
    kernels = costs["pallas"].kernels
    # 2 layers x 2 iterations forward and backward, and under remat the first iteration's
    # forward again (the backward needs the second's inputs, not its output)
    assert kernels.get("pallas dag forward") == 6 and kernels.get("pallas dag backward") == 4
    assert "pallas dag forward" not in costs["xla_rank3"].kernels
    assert costs["pallas"].hbm_bytes < costs["xla_rank3"].hbm_bytes
    # the module's own instructions (its named scope): fewer launches, under half the bytes
    assert modules["pallas"].launches < modules["xla_rank3"].launches
    assert modules["pallas"].hbm_bytes < 0.5 * modules["xla_rank3"].hbm_bytes, (
        modules["pallas"].hbm_bytes, modules["xla_rank3"].hbm_bytes)
    assert costs["pallas"].matmul_flops == pytest.approx(costs["xla_rank3"].matmul_flops,
                                                         rel=0.1)


def dag_module_keeps_its_node_axis_on_tpu(settled, cost, chip, mesh) -> None:
    """'auto' settles the DAG module to 'xla_rank3' on TPU: its projections on the [T, K, .]
    node arrays as they are. The same step with the CPU's [T*K, .] rows ('xla') pays a relayout
    copy at every projection (K = 4 rows in 8-row tiles): the XLA:TPU program moves more HBM
    bytes (about 13% more here, 21% at DAG-MoE-l), though 'xla' computes the L-th iteration
    with the readout, W_up on the summed messages (fewer matmul FLOPs, by 3/4 of that W_up)."""
    from dagmoe_jax.compile.programs import compile_run
    assert settled.dag_module == "xla_rank3"
    cfg, data = small_dag(), DataConfig(batch_size=8, seq_len=128)
    rows_settled, reports = compile_run(
        cfg, data, OptimConfig(), RunConfig(execution=ExecutionConfig(dag_module="xla")), mesh,
        chip, programs=("train",))
    assert rows_settled.dag_module == "xla"
    rows = reports["train"].cost
    # the L-th W_up on 1 summed row a token instead of K: (K - 1) [d_g, d] products a token
    # and layer, forward and twice backward
    saved = (3 * 2 * data.batch_size * data.seq_len * (cfg.block.router.top_k - 1)
             * cfg.block.aggregation.dag_dim * cfg.d_model * cfg.num_layers)
    assert cost.matmul_flops - rows.matmul_flops == pytest.approx(saved, rel=0.05)
    assert cost.hbm_bytes < 0.95 * rows.hbm_bytes, (cost.hbm_bytes, rows.hbm_bytes)


def expert_weights_sharded_by_the_rules(hlo: str, cfg, mesh) -> None:
    """The compiled (SPMD-partitioned) step's entry parameters are one chip's shards: each
    routed expert weight arrives as the shard its logical names map to under the mesh rules
    (the ``expert`` axis over the mesh's expert axis), never whole."""
    from dagmoe_jax.run.state import build
    from dagmoe_jax.parallel.state import variable_spec
    entry = hlo[hlo.index("ENTRY"):].split("\n", 1)[0]
    model, _, _ = build(cfg, OptimConfig(), RunConfig(), mesh, backend="tpu", abstract=True)
    checked = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        names = var.get_metadata().get("out_sharding") or ()
        if "expert" not in names:
            continue
        spec = variable_spec(var)
        assert spec[names.index("expert")] == "expert", (path, spec)
        value = var.get_value()
        local = NamedSharding(mesh, spec).shard_shape(value.shape)
        assert local != value.shape
        text = lambda shape: f"f32[{','.join(map(str, shape))}]"  # noqa: E731
        assert text(local) in entry and text(value.shape) not in entry, (path, local)
        checked += 1
    assert checked >= 3      # w_gate, w_up, w_down


@needs_tpu_compiler
def test_s_model_compiles_under_data_x_expert(v5p):
    """The paper's s model (vocabulary 128,256, 32 experts of 256, top-4), train step only."""
    from dagmoe_jax.compile.programs import compile_run
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    from dagmoe_jax.run.gin import load_model_config
    chip, devices = v5p
    cfg = load_model_config(["models/s.gin", "variants/dag_g128_l2.gin"],
                            ["ModelConfig.compute_dtype = 'bfloat16'"])
    _, reports = compile_run(cfg, DataConfig(batch_size=4, seq_len=256), OptimConfig(),
                             RunConfig(), make_mesh(MeshConfig(data=2, expert=2), devices),
                             chip, programs=("train",))
    train = reports["train"]
    # float32 parameters and two AdamW moments: 12 bytes a parameter, of which each chip holds
    # every one but half the routed experts' (32 experts over expert 2)
    from dagmoe_jax.model.accounting import account
    acc = account(cfg, 256)
    per_chip = acc.total_params - acc.params["experts"] / 2
    assert train.state_bytes == pytest.approx(12 * per_chip, rel=1e-3)
    assert train.total_bytes < chip.hbm_bytes
    assert {"gmm", "tgmm", "splash_mha_fwd"} <= set(train.cost.kernels)
    # the dispatch's share: its exchanges and data movement, none of the experts' products
    part = train.dispatch
    assert part.collective_seconds > 0 and part.seconds > 0 and part.matmul_flops == 0
    assert part.seconds < train.cost.compute_seconds / 4


@needs_tpu_compiler
def test_generation_and_eval_compile(v5p):
    from dagmoe_jax.compile.programs import GenerationShape, compile_run
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    chip, devices = v5p
    _, reports = compile_run(small_dag(), DataConfig(batch_size=4, seq_len=128), OptimConfig(),
                             RunConfig(), make_mesh(MeshConfig(data=1), devices[:1]), chip,
                             programs=("eval", "prefill", "decode"),
                             generation=GenerationShape(2, 128, 64))
    assert set(reports) == {"eval", "prefill", "decode"}
    assert "splash_mha_fwd" in reports["prefill"].cost.kernels
    assert reports["decode"].tokens == 2 and reports["decode"].cost.seconds > 0


@needs_tpu_compiler
def test_oversized_batch_is_one_line(capsys):
    from dagmoe_jax.compile.__main__ import main
    code = main(["--gin_file=models/tiny.gin", "--gin.ModelConfig.compute_dtype='bfloat16'",
                 "--gin.ModelConfig.d_model=1024", "--gin.DataConfig.batch_size=262144",
                 "--gin.DataConfig.seq_len=128",
                 "--gin.ModelConfig.max_seq_len=128", "--programs=train",
                 "--topology=v5p:2x2x1", "--gin.MeshConfig.data=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "does not fit a v5p chip" in err[0] and "GB over" in err[0], err[0]
    assert "batch_size" in err[0] and "fsdp" in err[0]


@needs_tpu_compiler
def test_the_compile_report_names_the_exchange_and_its_buffer(capsys):
    """The report's settled line says how expert-parallel dropless dispatch runs on the mesh
    and, with ExpertConfig.exchange_buffer, that the overflow beyond the bound drops."""
    from dagmoe_jax.compile.__main__ import main
    code = main(["--gin_file=models/tiny.gin", "--gin.ModelConfig.compute_dtype='bfloat16'",
                 "--gin.DataConfig.batch_size=8", "--gin.DataConfig.seq_len=128",
                 "--gin.ExpertConfig.dispatch='dropless'",
                 "--gin.ExpertConfig.exchange_buffer=1.25", "--programs=train",
                 "--topology=v5p:2x2x1", "--gin.MeshConfig.data=2", "--gin.MeshConfig.expert=2"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(l for l in out.splitlines() if l.startswith("model settled for tpu"))
    assert "expert-parallel over" in line and "by ragged_all_to_all" in line, line
    assert line.endswith("receive buffer 1.25x the balanced share (the overflow drops)"), line


def test_kernels_refused_under_highest_precision():
    """Building a run (run.build, and the compile command's abstract state) refuses the
    Pallas TPU kernels under 'highest' in one line."""
    from dagmoe_jax.run.state import build
    from dagmoe_jax.model.settle import check_kernel_precision
    with jax.default_matmul_precision("highest"):
        with pytest.raises(ValueError, match="Bad lhs type.*ExecutionConfig.attention='xla'"):
            check_kernel_precision("splash", "ragged_dot", "tpu")
        with pytest.raises(ValueError, match="megablox gmm"):
            build(small_dag(), OptimConfig(),
                  RunConfig(execution=ExecutionConfig(attention="xla")),
                  jax.sharding.Mesh(jax.devices()[:1], ("data",)), backend="tpu", abstract=True)
        # XLA's own attention and ragged_dot take any precision; CPU is never refused
        check_kernel_precision("xla", "ragged_dot", "tpu")
        check_kernel_precision("splash", "gmm", "cpu")


def test_bad_topology_is_one_line(capsys):
    from dagmoe_jax.compile.__main__ import main
    assert main(["--topology=v9x:2x2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "v5p:2x2x1" in err[0]
    with pytest.raises(ValueError, match="3D"):
        parse_topology("v5p:4x4")
    assert parse_topology("v6e:8x8")[1] == (8, 8)


HLO = """HloModule step, entry_computation_layout={()->f32[]}

%fused_dot (p0: bf16[256,512], p1: bf16[512,1024]) -> bf16[256,1024] {
  %p0 = bf16[256,512]{1,0} parameter(0)
  %p1 = bf16[512,1024]{1,0} parameter(1)
  ROOT %dot.1 = bf16[256,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cond (param: (s32[], bf16[256,512])) -> pred[] {
  %param = (s32[], bf16[256,512]{1,0}) parameter(0)
  %gte = s32[] get-tuple-element(%param), index=0
  %limit = s32[] constant(8)
  ROOT %lt = pred[] compare(%gte, %limit), direction=LT
}

%body (param.1: (s32[], bf16[256,512])) -> (s32[], bf16[256,512]) {
  %param.1 = (s32[], bf16[256,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param.1), index=0
  %x = bf16[256,512]{1,0} get-tuple-element(%param.1), index=1
  %w = bf16[512,1024]{1,0} constant({...})
  %f = bf16[256,1024]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %ag = bf16[1024,512]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (s32[], bf16[256,512]{1,0}) tuple(%i, %x)
}

ENTRY %main (a: bf16[256,512]) -> f32[] {
  %a = bf16[256,512]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[256,512]{1,0}) tuple(%zero, %a)
  %loop = (s32[], bf16[256,512]{1,0}) while(%init), condition=%cond, body=%body
  %ar = f32[1024]{0} all-reduce(%a), channel_id=2, replica_groups=[2,2]<=[4], to_apply=%add
  ROOT %c = f32[] constant(0)
}
"""


def test_roofline_reads_a_known_module():
    """8 trips of a fused 256x512 @ 512x1024 product and an all-gather over 4 chips, one
    all-reduce over groups of 2: every figure by hand."""
    chip = CHIPS["v5p"]
    cost = roofline.program_cost(HLO, chip, devices=4)
    flops = 8 * 2 * 256 * 512 * 1024
    assert cost.matmul_flops == flops
    fusion_bytes = 2 * (256 * 512 + 512 * 1024 + 256 * 1024)
    # (plus the loop condition's compare: 9 bytes a trip)
    assert cost.hbm_bytes == 8 * fusion_bytes + 8 * 9
    assert cost.compute_seconds == pytest.approx(
        8 * max(flops / 8 / chip.peak_flops, fusion_bytes / chip.hbm_bandwidth), rel=1e-4)
    gathered = 8 * 2 * 1024 * 512 * 3 / 4
    reduced = 2 * (2 * 256 * 512) * 1 / 2     # all-reduce: twice the operand, (n-1)/n, n = 2
    assert cost.collectives["all-gather"] == {"count": 8, "bytes": gathered,
                                              "seconds": gathered / chip.ring_bandwidth}
    assert cost.collectives["all-reduce"]["bytes"] == reduced
    assert cost.seconds == pytest.approx(cost.compute_seconds
                                         + (gathered + reduced) / chip.ring_bandwidth)
    assert cost.overlapped_seconds == max(cost.compute_seconds, cost.collective_seconds)
    # across slices the same all-gather runs at the data-centre network's bandwidth
    split = roofline.program_cost(HLO, chip, devices=4, slice_of=[0, 0, 1, 1])
    assert split.collectives["all-gather"]["seconds"] == pytest.approx(
        gathered / chip.dcn_bandwidth)
    # the iota groups [2,2]<=[4] are {0,1} and {2,3}: within a slice each
    assert split.collectives["all-reduce"]["seconds"] == pytest.approx(
        reduced / chip.ring_bandwidth)
    across = roofline.program_cost(HLO.replace("[2,2]<=[4]", "[2,2]<=[2,2]T(1,0)"), chip,
                                   devices=4, slice_of=[0, 0, 1, 1])
    assert across.collectives["all-reduce"]["seconds"] == pytest.approx(
        reduced / chip.dcn_bandwidth)


SCATTER_HLO = """HloModule scatter, entry_computation_layout={()->bf16[256,512]}

%all-reduce-scatter.3.clone (input: bf16[1024,512]) -> bf16[256,512] {
  %input = bf16[1024,512]{1,0} parameter(0)
  %all-reduce.7 = bf16[1024,512]{1,0} all-reduce(%input), channel_id=3, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  %pid = u32[] partition-id()
  %four = u32[] constant(256)
  %offset = u32[] multiply(%pid, %four)
  %zero = u32[] constant(0)
  ROOT %slice = bf16[256,512]{1,0} dynamic-slice(%all-reduce.7, %offset, %zero), dynamic_slice_sizes={256,512}
}

ENTRY %main (g: bf16[1024,512]) -> bf16[256,512] {
  %g = bf16[1024,512]{1,0} parameter(0)
  ROOT %rs = bf16[256,512]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.3.clone
}
"""


def test_a_fused_all_reduce_scatter_is_a_reduce_scatter():
    """XLA:TPU's reduce-scatter, a kCustom fusion of an all-reduce and the chip's slice,
    moves (n - 1) / n of its operand over the ring, and costs no compute of its own."""
    chip = CHIPS["v5p"]
    cost = roofline.program_cost(SCATTER_HLO, chip, devices=4)
    moved = 2 * 1024 * 512 * 3 / 4
    assert cost.collectives == {"reduce-scatter": {"count": 1, "bytes": moved,
                                                   "seconds": moved / chip.ring_bandwidth}}
    assert cost.compute_seconds == 0 and cost.hbm_bytes == 0


GMM_HLO = """HloModule gmm, entry_computation_layout={()->bf16[512,128]}

ENTRY %main (a: bf16[512,128], w: bf16[2,128,128], g: s32[2]) -> bf16[512,128] {
  %a = bf16[512,128]{1,0} parameter(0)
  %w = bf16[2,128,128]{2,1,0} parameter(1)
  %g = s32[2]{0} parameter(2)
  ROOT %gmm.7 = bf16[512,128]{1,0} custom-call(%a, %w, %g), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"cost_estimate":{"flops":"16777216","transcendentals":"0"}}}
}
"""


def test_grouped_matmul_flops_scale_by_occupancy():
    """megablox gmm's cost estimate counts its whole (worst-case) buffer: 2 x 512 x 128 x 128
    FLOPs; at occupancy 1/2 (two expert shards) the roofline counts half."""
    chip = CHIPS["v5p"]
    full = roofline.program_cost(GMM_HLO, chip, devices=1)
    half = roofline.program_cost(GMM_HLO, chip, devices=1, gmm_occupancy=0.5)
    assert full.kernels == {"gmm": 1} and full.matmul_flops == 2 * 512 * 128 * 128
    assert half.matmul_flops == full.matmul_flops / 2 and half.hbm_bytes == full.hbm_bytes


@needs_tpu_compiler
def test_gmm_occupancy_of_a_mesh(v5p):
    from dagmoe_jax.compile.programs import gmm_occupancy
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    _, devices = v5p
    mesh = make_mesh(MeshConfig(data=2, expert=2), devices)
    cfg = small_dag()
    assert cfg.block.experts.dispatch == "dropless"
    assert gmm_occupancy(cfg, mesh, tokens=512) == 0.5
    assert gmm_occupancy(cfg, mesh, tokens=3) == 1.0          # global-view fallback
    assert gmm_occupancy(cfg, make_mesh(MeshConfig(data=4), devices), tokens=512) == 1.0
    # a receive buffer of 1.25x the balanced share (ExpertConfig.exchange_buffer): 1 / 1.25;
    # one at least E wide is the worst case's 1 / E
    for factor, occupancy in ((1.25, 0.8), (3.0, 0.5)):
        bounded = cfg.replace(block=dict(experts=dict(exchange_buffer=factor)))
        assert gmm_occupancy(bounded, mesh, tokens=512) == occupancy


def _instruction(line: str, shapes: dict):
    from dagmoe_jax.compile.hlo import parse_module
    text = "HloModule m\n\nENTRY %main () -> f32[] {\n  " + line + "\n}\n"
    computations, entry = parse_module(text)
    return computations[entry][-1]


def test_convolution_flops_count_only_taps_on_the_input():
    """XLA:TPU's batched matmul as a convolution over the batch (the LM head's weight gradient
    of a compiled step): window 8 padded 7 each side over an input of 1 position, so each of
    the 8 outputs meets one tap: the dot's 2 x 1024 x 8 x 2048 x 128256, not 8 times that."""
    shapes = {"a": "bf16[1024,128256,1]", "b": "bf16[8,2048,128256]"}
    conv = _instruction("ROOT %c = bf16[1024,8,2048]{2,0,1} convolution(%a, %b), "
                        "window={size=8 pad=7_7 rhs_reversal=1}, dim_labels=bf0_0oi->b0f",
                        shapes)
    assert roofline.dot_flops(conv, shapes) == 2 * 1024 * 8 * 2048 * 128256
    # a plain 1-D convolution: input 10, window 3, no padding: 8 outputs of 3 taps each
    shapes = {"x": "f32[2,10,4]", "k": "f32[3,4,5]"}
    valid = _instruction("ROOT %c = f32[2,8,5]{2,1,0} convolution(%x, %k), window={size=3}, "
                         "dim_labels=b0f_0io->b0f", shapes)
    assert roofline.dot_flops(valid, shapes) == 2 * 2 * 5 * 4 * 8 * 3
    # stride 2 with padding 1_1: outputs 0..4 see 2, 3, 3, 3, 3 taps (output 0 starts on pad)
    strided = _instruction("ROOT %c = f32[2,5,5]{2,1,0} convolution(%x, %k), "
                           "window={size=3 stride=2 pad=1_1}, dim_labels=b0f_0io->b0f", shapes)
    assert roofline.dot_flops(strided, shapes) == 2 * 2 * 5 * 4 * (2 + 3 + 3 + 3 + 3)
    # two spatial dims, the kernel's labelled '1' before '0': the window's pad lists dim 0 first
    shapes = {"x": "f32[2,10,1,4]", "k": "f32[1,3,4,5]"}
    two = _instruction("ROOT %c = f32[2,10,1,5]{3,2,1,0} convolution(%x, %k), "
                       "window={size=3x1 pad=1_1x0_0}, dim_labels=b01f_10io->b01f", shapes)
    assert roofline.dot_flops(two, shapes) == 2 * 2 * 5 * 4 * (2 + 8 * 3 + 2)


SLICED_HLO = """HloModule scan, entry_computation_layout={()->f32[]}

%read_layer (p0: f32[8,256,256], p1: s32[], p2: f32[64,256]) -> f32[64,256] {
  %p0 = f32[8,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,256,256}
  %w = f32[256,256]{1,0} bitcast(%ds)
  %p2 = f32[64,256]{1,0} parameter(2)
  ROOT %dot = f32[64,256]{1,0} dot(%p2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%write_layer (q0: f32[8,64,256], q1: f32[1,64,256], q2: s32[]) -> f32[8,64,256] {
  %q0 = f32[8,64,256]{2,1,0} parameter(0)
  %q1 = f32[1,64,256]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[8,64,256]{2,1,0} dynamic-update-slice(%q0, %q1, %q2, %z, %z)
}

ENTRY %main (w: f32[8,256,256], x: f32[64,256], i: s32[], y: f32[8,64,256], u: f32[1,64,256], t: bf16[1000,64], ids: s32[32]) -> f32[] {
  %w = f32[8,256,256]{2,1,0} parameter(0)
  %x = f32[64,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %y = f32[8,64,256]{2,1,0} parameter(3)
  %u = f32[1,64,256]{2,1,0} parameter(4)
  %read = f32[64,256]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%read_layer
  %write = f32[8,64,256]{2,1,0} fusion(%y, %u, %i), kind=kLoop, calls=%write_layer
  %ws = ((f32[8,64,256]{2,1,0}, f32[1,64,256]{2,1,0}, s32[]), f32[8,64,256]{2,1,0}, u32[]) fusion-start(%write, %u, %i), kind=kLoop, calls=%write_layer
  %wd = f32[8,64,256]{2,1,0} fusion-done(%ws)
  %t = bf16[1000,64]{1,0} parameter(5)
  %ids = s32[32]{0} parameter(6)
  %cs = ((bf16[1000,64]{1,0}, s32[32]{0}), bf16[32,64]{1,0}, u32[]) call-start(%t, %ids), async_execution_thread="sparsecore", to_apply=%read_layer
  %cu = ((bf16[1000,64]{1,0}, s32[32]{0}), bf16[32,64]{1,0}, u32[]) call-update(%cs)
  %cd = bf16[32,64]{1,0} call-done(%cu)
  %empty = bf16[4096,1024]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %c = f32[] constant(0)
}
"""


def test_multislice_mesh_spans_slices_by_data_alone():
    """make_mesh over two v5p slices: the data axis crosses the slices, every other axis stays
    inside one; a data axis the slices do not divide is one line."""
    from dagmoe_jax.compile.chips import topology_devices
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    _, devices = topology_devices("v5p:2x2x1", num_slices=2)
    mesh = make_mesh(MeshConfig(data=2, expert=4), devices, num_slices=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()
    with pytest.raises(ValueError, match="MeshConfig.data=1 must be a multiple of --num_slices=2"):
        make_mesh(MeshConfig(data=1, expert=8), devices, num_slices=2)


def test_sliced_buffers_count_their_slices():
    """A fusion reading one layer of stacked weights by dynamic-slice reads that layer; one
    writing a layer's slice in place writes the slice, not the stack, and so does the same
    fusion run asynchronously (jax 0.11's XLA:GPU: fusion-start / -done, whose shape lists
    the operands, the result and a context); a gather offloaded to the SparseCore
    (call-start / -update / -done) reads and writes its 32 rows, not the table; ``lax.empty``'s
    buffer (an ``AllocateBuffer`` custom call) moves nothing."""
    cost = roofline.program_cost(SLICED_HLO, CHIPS["v5p"], devices=1)
    read = 4 * (256 * 256 + 1 + 64 * 256) + 4 * 64 * 256
    write = 4 * (64 * 256 + 1) + 4 * 64 * 256
    gather = 2 * 2 * 32 * 64
    assert cost.hbm_bytes == read + 2 * write + gather
    assert cost.matmul_flops == 2 * 64 * 256 * 256


def test_the_dag_kernels_are_named_and_counted_from_their_shapes():
    """The DAG iteration's Triton kernels (kernels/triton_dag_module.py), told by their
    pallas_call name (their operand ranks would read as a grouped matmul's): forward
    2 R (2 d d_g + 4 d_g^2), backward 2 R (5 d d_g + 8 d_g^2) from rows [R, d], W_down [d, d_g]."""
    shapes = {"r": "bf16[256,64]", "x": "bf16[64,64]", "s": "f32[64]", "b": "f32[64]",
              "wd": "bf16[64,16]", "wp": "bf16[16,64]", "wu": "bf16[16,64]"}
    calls = {}
    for kind in ("forward", "backward"):
        calls[kind] = _instruction(
            f"ROOT %p = bf16[256,64]{{1,0}} custom-call(%r, %x, %s, %b, %wd, %wp, %wu), "
            f'custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="jit(f)/'
            f'dagmoe_triton_dag_{kind}/pallas_call"}}', shapes)
        assert kernel_costs.gpu_kernel_family("__gpu$xla.gpu.triton", calls[kind],
                                              shapes) == f"triton dag {kind}"
    rows, d, g = 256, 64, 16
    assert kernel_costs.dag_kernel_flops(False, calls["forward"], shapes) == (
        2 * rows * (2 * d * g + 4 * g * g))
    assert kernel_costs.dag_kernel_flops(True, calls["backward"], shapes) == (
        2 * rows * (5 * d * g + 8 * g * g))


def test_grouped_matmul_flops_from_shapes():
    """A gmm / tgmm without a cost estimate (MaxText's): 2 M K N from its operands."""
    shapes = {"x": "bf16[512,1024]", "w": "bf16[16,1024,256]", "g": "s32[16]",
              "xt": "bf16[1024,512]", "dy": "bf16[512,256]"}
    gmm = _instruction('ROOT %gmm.3 = bf16[512,256]{1,0} custom-call(%x, %w, %g), '
                       'custom_call_target="tpu_custom_call"', shapes)
    tgmm = _instruction('ROOT %tgmm.1 = bf16[16,1024,256]{2,1,0} custom-call(%xt, %dy, %g), '
                        'custom_call_target="tpu_custom_call"', shapes)
    assert kernel_costs.mosaic_flops("gmm", gmm, shapes) == 2 * 512 * 1024 * 256
    assert kernel_costs.mosaic_flops("tgmm", tgmm, shapes, 0.5) == 512 * 1024 * 256
    # jax 0.11 names the calls tpu_custom_call.N: megablox is told by its five int32
    # metadata operands and its result's rank
    meta = {f"m{i}": "s32[16]" for i in range(5)}
    named = {**shapes, **meta}
    operands = ", ".join(f"%m{i}" for i in range(5))
    anonymous = _instruction(f'ROOT %tpu_custom_call.7 = bf16[16,1024,256]{{2,1,0}} custom-call('
                             f'{operands}, %xt, %dy), custom_call_target="tpu_custom_call"', named)
    assert kernel_costs.megablox_family(anonymous, named) == "tgmm"
    assert kernel_costs.megablox_family(gmm, shapes) is None


def test_kernel_families():
    assert kernel_costs.kernel_family("transpose_jvp_jit_tgmm___") == "tgmm"
    assert kernel_costs.kernel_family("jvp_jit_gmm__") == "gmm"
    assert kernel_costs.kernel_family("splash_mha_dkv_no_residuals") == "splash_mha_dkv"
    assert kernel_costs.kernel_family("jvp_dagmoe_pallas_dag_forward_.2.refs_0_") == \
        "pallas dag forward"
    assert kernel_costs.kernel_family("transpose_jvp_dagmoe_pallas_dag_backward__") == \
        "pallas dag backward"


def test_search_reuses_cached_outcomes(tmp_path):
    """A search run again compiles only what it has not: cached outcomes come back without a
    call and cost no budget; another configuration's key sees none of them."""
    from dagmoe_jax.compile.search import Candidate, Outcome, OutcomeCache, search
    todo = [Candidate((4, 1, 1, 1), 2), Candidate((2, 1, 2, 1), 2), Candidate((1, 1, 4, 1), 2)]
    compiled = []

    def compile_one(c):
        compiled.append(c)
        return (Outcome(c, error="out of memory") if c.sizes[2] == 4
                else Outcome(c, 1.0 / c.sizes[2], 1000.0 * c.sizes[2], 0.1, 5e9))

    first = search(compile_one, todo[:2], budget_seconds=60, log=lambda _m: None,
                   cache=OutcomeCache(tmp_path, "run A"))
    assert len(compiled) == 2
    again = search(compile_one, todo, budget_seconds=60, log=lambda _m: None,
                   cache=OutcomeCache(tmp_path, "run A"))
    assert compiled[2:] == [todo[2]]             # only the new candidate compiled
    assert again[:2] == first and again[2].error == "out of memory"
    search(compile_one, todo[:1], budget_seconds=60, log=lambda _m: None,
           cache=OutcomeCache(tmp_path, "run B"))
    assert compiled[3:] == [todo[0]]


def test_search_candidates_respect_the_model():
    from dagmoe_jax.compile.search import candidates, factorisations
    assert len(list(factorisations(8))) == 20          # ordered 4-factorisations of 2^3
    cfg = small_dag()          # 4 experts, 2 KV heads
    found = candidates(cfg, 8, [1, 2], first=((8, 1, 1, 1), 2))
    assert found[0].sizes == (8, 1, 1, 1) and found[0].batch_per_chip == 2
    assert all(c.sizes[2] in (1, 2, 4) and c.sizes[3] in (1, 2) for c in found)
    assert all(c.batch_per_chip * 8 % (c.sizes[0] * c.sizes[1] * c.sizes[2]) == 0
               for c in found)
    assert any(c.sizes == (2, 1, 4, 1) for c in found)
    assert not any(c.sizes[2] == 8 or c.sizes[3] == 4 for c in found)
    assert found[0].bindings() == ["MeshConfig.data = 8", "MeshConfig.fsdp = 1",
                                   "MeshConfig.expert = 1", "MeshConfig.tensor = 1",
                                   "DataConfig.batch_size = 16"]


def test_the_search_tries_fsdp_and_mixed_meshes_early_and_bounded_buffers():
    """Search order: data, FSDP and mixed meshes before wide expert parallelism and tensor
    parallelism; each mesh with an expert axis (dropless) also tries the bounded buffers asked
    for, before its own, each with its binding and label; a capacity model tries none."""
    from dagmoe_jax.compile.search import OWN, candidates
    cfg = small_dag()          # 4 experts, 2 KV heads, dropless
    found = candidates(cfg, 8, [2], first=((8, 1, 1, 1), 2), buffers=[1.25, None])
    sizes = [c.sizes for c in found]
    assert sizes[:4] == [(8, 1, 1, 1), (4, 2, 1, 1), (2, 4, 1, 1), (1, 8, 1, 1)]
    expert = [c.sizes[2] for c in found if c.sizes[3] == 1]
    assert expert == sorted(expert)                         # expert parallelism ascending
    assert all(c.sizes[3] == 1 for c in found[:found.index(next(
        c for c in found if c.sizes[3] > 1))])              # tensor parallelism last
    ep = [c for c in found if c.sizes == (4, 1, 2, 1)]
    assert [c.exchange_buffer for c in ep] == [1.25, OWN]   # None is the run's own
    assert ep[0].bindings()[-1] == "ExpertConfig.exchange_buffer = 1.25"
    assert ep[0].label().endswith("buffer 1.25x")
    assert ep[0].model_config(cfg).block.experts.exchange_buffer == 1.25
    assert all(c.exchange_buffer == OWN for c in found if c.sizes[2] == 1)
    capacity = cfg.replace(block=dict(experts=dict(dispatch="capacity")))
    assert all(c.exchange_buffer == OWN for c in candidates(capacity, 8, [2], buffers=[1.25]))


def test_maxtext_flags_describe_the_same_model(monkeypatch):
    """benchmarks/maxtext_compile.py hands MaxText the MoE-l shape and our mesh: a fair
    comparison needs every dimension equal."""
    from benchmarks import maxtext_compile as bench
    from dagmoe_jax.run.gin import load_model_config
    cfg = load_model_config(["models/l.gin", "variants/moe.gin"])
    flags = dict(f.split("=", 1) for f in bench.maxtext_flags(
        cfg, 32, 2048, 4, bench.parse_mesh("data=2,expert=2"), "v5p:2x2x1"))
    assert flags["compile_topology"] == "v5p-8" and flags["decoder_block"] == "mixtral"
    assert {k: int(flags[k]) for k in ("base_emb_dim", "base_num_query_heads",
                                       "base_num_kv_heads", "head_dim", "base_moe_mlp_dim",
                                       "base_num_decoder_layers", "num_experts",
                                       "num_experts_per_tok", "vocab_size",
                                       "max_target_length", "per_device_batch_size",
                                       "ici_data_parallelism", "ici_expert_parallelism",
                                       "ici_fsdp_parallelism")} == {
        "base_emb_dim": 1024, "base_num_query_heads": 32, "base_num_kv_heads": 8,
        "head_dim": 32, "base_moe_mlp_dim": 512, "base_num_decoder_layers": 8,
        "num_experts": 32, "num_experts_per_tok": 4, "vocab_size": 128256,
        "max_target_length": 2048, "per_device_batch_size": 8, "ici_data_parallelism": 2,
        "ici_expert_parallelism": 2, "ici_fsdp_parallelism": 1}


@needs_tpu_compiler
def test_mesh_axes_that_split_a_torus_axis():
    """32 expert shards over a 4x4x4 slice: no product of whole torus axes is 32, so the mesh
    splits one (jax.make_mesh alone refuses)."""
    from dagmoe_jax.compile.chips import topology_devices
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    _, devices = topology_devices("v5p:4x4x4")
    mesh = make_mesh(MeshConfig(data=2, expert=32), devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 32, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


def test_search_buffers_are_factors_or_none():
    from dagmoe_jax.compile.__main__ import parse_args
    assert parse_args(["--search_buffers=1.25,none"]).search_buffers == [1.25, None]
    assert parse_args(["--search_buffers="]).search_buffers == []
    for bad in ("0.5", "wide"):
        with pytest.raises(ValueError, match=f"--search_buffers={bad} is invalid"):
            parse_args([f"--search_buffers={bad}"])
