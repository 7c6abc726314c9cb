"""benchmarks/step_profile.py: its HLO parsing and categories on a hand-written module, and the
whole profile of a micro model's step."""

from __future__ import annotations

import subprocess

import pytest

from benchmarks import step_profile
from conftest import benchmark_command, single_device_env
from dagmoe_jax.kernels.grouped_matmul import grouped_matmul_unavailable

HLO = """HloModule jit_step

%fused_computation (param_0: f32[4,8]) -> f32[8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %slice.1 = f32[1,8]{1,0} slice(%param_0), slice={[0:1], [0:8]}
  ROOT %bitcast.1 = f32[8]{0} bitcast(%slice.1)
}

%fused_computation.1 (param_0.1: f32[8], param_1: f32[8]) -> f32[8] {
  %param_0.1 = f32[8]{0} parameter(0)
  %param_1 = f32[8]{0} parameter(1)
  ROOT %multiply.1 = f32[8]{0} multiply(%param_0.1, %param_1)
}

ENTRY %main (model_states_0_: f32[4,8], optimizer_states_1_: f32[8], x: f32[2,8]) -> f32[8] {
  %model_states_0_ = f32[4,8]{1,0} parameter(0)
  %optimizer_states_1_ = f32[8]{0} parameter(1)
  %x = f32[2,8]{1,0} parameter(2)
  %slice_bitcast_fusion = f32[8]{0} fusion(%model_states_0_), kind=kLoop, calls=%fused_computation
  %dot.3 = f32[2]{0} dot(%x, %slice_bitcast_fusion), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ffi_call.2 = f32[2,8]{1,0} custom-call(%x), custom_call_target="dagmoe_causal_attention_fwd"
  %ffi_call.3 = f32[2,8]{1,0} custom-call(%x), custom_call_target="dagmoe_gmm"
  %transpose.4 = f32[8,2]{1,0} transpose(%x), dimensions={1,0}
  ROOT %multiply_fusion = f32[8]{0} fusion(%optimizer_states_1_, %slice_bitcast_fusion), kind=kLoop, calls=%fused_computation.1
}
"""


def test_categories_of_a_hand_written_module():
    instructions, computations = step_profile.parse_hlo(HLO)
    assert instructions["dot.3"]["operands"] == ["x", "slice_bitcast_fusion"]
    assert computations["fused_computation"] == ["parameter", "slice", "bitcast"]
    got = {name: step_profile.categorize(name, instructions, computations)
           for name in ("slice_bitcast_fusion", "dot.3", "ffi_call.2", "ffi_call.3", "transpose.4",
                        "multiply_fusion", "missing")}
    assert got == {"slice_bitcast_fusion": "weight copy", "dot.3": "matmul",
                   "ffi_call.2": "attention", "ffi_call.3": "grouped mm",
                   "transpose.4": "data movement", "multiply_fusion": "optimizer",
                   "missing": "other"}


def test_instruction_seconds_average_over_executions():
    ev = lambda op, run, ts, dur: {"ph": "X", "ts": ts, "dur": dur, "name": op,  # noqa: E731
                                   "args": {"hlo_op": op, "hlo_module": "jit_step", "run_id": run}}
    events = [ev("a", "1", 0, 100), ev("b", "1", 100, 300), ev("a", "2", 1000, 300),
              ev("b", "2", 1300, 100), {"ph": "X", "ts": 0, "dur": 5, "name": "python"}]
    per, span = step_profile.instruction_seconds(events)
    assert per == pytest.approx({"a": 200e-6, "b": 200e-6})
    assert span == pytest.approx(400e-6)
    with pytest.raises(RuntimeError, match="no instruction"):
        step_profile.instruction_seconds(events[-1:])


# `perf report --stdio --no-children --sort dso,sym` as perf 6 prints it (shortened).
PERF_REPORT = """# Samples: 38K of event 'cpu-clock'
#
# Overhead  Shared Object                         Symbol
# ........  ....................................  ......
#
    22.10%  grouped_matmul-92bb01a6282cde78.so    [.] (anonymous namespace)::Tile<8, false>
    11.09%  libjax_common.so                      [.] ynn::dot_fp32_5x64x1_1x16x1_avx512
     5.41%  causal_attention-15c8518cb160e17f.so  [.] (anonymous namespace)::BackwardItem<16, false>
     1.87%  libjax_common.so                      [.] Eigen::internal::gemm_pack_colmajor_block
     1.27%  [kernel.kallsyms]                     [k] pv_native_safe_halt
     0.70%  libc.so.6                             [.] _int_malloc
     0.58%  [kernel.kallsyms]                     [k] exc_page_fault
     0.51%  dag_module-63f95afe3835b947.so        [.] (anonymous namespace)::LayerNormBackward
     0.38%  libpython3.11.so.1.0                  [.] gc_collect_main
     0.25%  [JIT] tid 18289                       [.] 0x00007ff5838f4172
     0.24%  [JIT] tid 18289                       [.] 0x00007ff5838f423c
     0.17%  libjax_common.so                      [.] absl::internal_any_invocable::LocalInvoker
     0.15%  libm.so.6                             [.] __sincosf_fma
"""


def test_perf_samples_are_grouped_by_the_code_they_land_in():
    groups = step_profile.perf_groups(PERF_REPORT)
    assert groups == pytest.approx({
        "grouped matmul kernel": 22.10, "XLA matmul libraries": 11.09 + 1.87,
        "attention kernel": 5.41, "idle": 1.27, "libc (malloc, memcpy)": 0.70,
        "OS kernel": 0.58, "DAG kernels": 0.51, "Python": 0.38,
        "XLA generated loops (fusions)": 0.25 + 0.24,
        "XLA runtime and other library code": 0.17, "other": 0.15})
    assert set(groups) <= {g for g, _, _ in step_profile.PERF_GROUPS} | {"other"}


def test_perf_mode_without_perf_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(step_profile.shutil, "which", lambda name: None)
    assert step_profile.main(["--perf", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "linux-perf" in err


@pytest.mark.slow
def test_micro_profile_prints_its_tables():
    env = single_device_env(DAGMOE_TCMALLOC="0")
    cmd = benchmark_command("step_profile", "--batch", "2", "--seq", "32", "--steps", "1",
                            "--top", "5")
    for b in ("ModelConfig.num_layers = 1", "ModelConfig.d_model = 64", "ModelConfig.num_heads = 4",
              "ModelConfig.num_kv_heads = 2", "ExpertConfig.num_experts = 4",
              "ExpertConfig.expert_hidden = 32", "RouterConfig.top_k = 2"):
        cmd += ["--binding", b]
    out = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.stdout.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in step_profile.CATEGORIES}
    # Matmuls and elementwise work are found, the optimizer's update too; shares add up to 1.
    assert {"matmul", "elementwise", "optimizer"} <= set(rows)
    assert sum(float(r[1].strip(" %")) for r in rows.values()) == pytest.approx(100, abs=0.5)
    slowest = out.stdout.split("slowest 5 instructions")[1]
    assert len([line for line in slowest.splitlines()
                if line.startswith("| ") and "ms/step" not in line]) == 5
    if grouped_matmul_unavailable("cpu") is not None:
        return  # no C++ compiler: capacity dispatch, no grouped matmul to count
    # One dropless layer: gate, up and down projections, each a forward and two gradients.
    calls = {line.split("|")[1].strip(): int(line.split("|")[3])
             for line in out.stdout.split("| custom call |")[1].split("slowest")[0].splitlines()
             if line.startswith("| dagmoe_")}
    assert {calls.get(t) for t in ("dagmoe_gmm", "dagmoe_gmm_t", "dagmoe_tgmm")} == {3}


def test_grouped_matmul_products_table_times_each_call_beside_the_matmul():
    """benchmarks/grouped_matmul.py's table of the kernel's three custom calls alone: one row
    each and the 2048^3 matmul's, every time positive (operands are passed, not closed over:
    a closed-over matmul was constant-folded to nothing)."""
    if grouped_matmul_unavailable("cpu") is not None:
        pytest.skip("the CPU grouped matmul kernel cannot be built here")
    from benchmarks import grouped_matmul

    rows = dict(grouped_matmul.products_table(64, 2, 4, 32, 16, repeats=1))
    assert list(rows) == ["forward x_g W_g", "input grad dy_g W_g^T",
                          "weight grad x_g^T dy_g", "matmul 2048^3"]
    assert all(t > 0 for t in rows.values())
    assert rows["matmul 2048^3"] > 1e-3          # 17 GFLOP cannot take under a millisecond


def test_grouped_matmul_weight_gradient_table_times_both_sides():
    """benchmarks/grouped_matmul.py's dense weight-gradient table: the DAG module's four shapes
    (T K rows into [d, d_g], [d_g, 4 d_g], [d_g, d]; T rows into [d_g, d]) and the router's and
    W_o's (T rows into [d, N], [d, d]), XLA and the kernel each timed, FLOPs 2 T K N."""
    if grouped_matmul_unavailable("cpu") is not None:
        pytest.skip("the CPU grouped matmul kernel cannot be built here")
    from benchmarks import grouped_matmul

    rows = grouped_matmul.weight_gradient_table(16, 4, 32, 16, repeats=1, experts=8)
    assert [r[0] for r in rows] == ["eq. 8 W_down [64, 32]^T [64, 16]",
                                    "eq. 9 W_pair [64, 16]^T [64, 64]",
                                    "eq. 11 W_up [64, 16]^T [64, 32]",
                                    "eq. 11-12 W_up summed [16, 16]^T [16, 32]",
                                    "router W_router [16, 32]^T [16, 8]",
                                    "attention W_o [16, 32]^T [16, 32]"]
    assert all(xla > 0 and kernel > 0 for _, xla, kernel, _ in rows)
    assert rows[0][3] == 2 * 64 * 32 * 16


def test_dag_module_benchmark_backs_each_projection_both_ways_with_a_random_cotangent():
    """benchmarks/dag_module.py: every projection row comes with XLA's weight gradient and the
    kernel's, which agree; the cotangent is random (a constant one let XLA fold each weight
    gradient into a column sum, and the table read those products as fast)."""
    if grouped_matmul_unavailable("cpu") is not None:
        pytest.skip("the CPU grouped matmul kernel cannot be built here")
    import jax.numpy as jnp
    import numpy as np
    from benchmarks import dag_module

    rows = {name: (fn, args) for name, fn, args, _ in dag_module.equation_rows(8, 4, 32, 16,
                                                                                "silu")}
    for eq in ("eq. 8 W_down", "eq. 9 pair projection", "eq. 11 W_up per node",
               "eq. 11-12 W_up summed"):
        (xla_fn, args), (kernel_fn, _) = rows[f"{eq}, XLA"], rows[f"{eq}, kernel"]
        run, cot = dag_module.vjp_fn(xla_fn, args)
        assert float(jnp.std(cot)) > 0.01, eq
        want, got = run(cot, *args), dag_module.vjp_fn(kernel_fn, args)[0](cot, *args)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_best_alternating_reverses_odd_rounds_and_keeps_each_best():
    """step_throughput.best_alternating, which the grouped-matmul tables time with: odd rounds
    in reverse order (each call after time_fn's warm-up), every name's best time returned in
    the given order."""
    from benchmarks import step_throughput

    calls = []
    best = step_throughput.best_alternating({n: (lambda n=n: calls.append(n)) for n in "ab"},
                                            repeats=1, rounds=2)
    assert calls == list("aabbbbaa")
    assert list(best) == ["a", "b"] and all(t >= 0 for t in best.values())
