"""benchmarks/step_profile.py: its HLO parsing and categories on a hand-written module, and the
whole profile of a micro model's step; benchmarks/device_trace.py's kernel table off a real
``jax.profiler`` trace made here (XLA:CPU) and off a hand-written GPU one, and the tables
benchmarks/accelerator.py keeps and prints of it."""

from __future__ import annotations

import glob
import gzip
import json
import subprocess

import pytest

from benchmarks import device_trace, step_profile
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


def test_best_alternating_reverses_odd_rounds_and_keeps_each_best(monkeypatch):
    """step_throughput.best_alternating, which the grouped-matmul tables time with: odd rounds
    in reverse order (each call after time_fn's warm-up), every name's best timed call
    returned in the given order; the warm-up calls are never counted. A fake clock that each
    call advances by a scripted duration (warm-ups 100 s) makes the times exact."""
    from benchmarks import step_throughput

    clock = [0.0]
    monkeypatch.setattr(step_throughput.time, "perf_counter", lambda: clock[0])
    script = {"a": [100.0, 5.0, 100.0, 2.0], "b": [100.0, 1.0, 100.0, 4.0]}
    calls = []

    def call(name):
        calls.append(name)
        clock[0] += script[name].pop(0)

    best = step_throughput.best_alternating({n: (lambda n=n: call(n)) for n in "ab"},
                                            repeats=1, rounds=2)
    assert calls == list("aabbbbaa")
    assert best == {"a": 2.0, "b": 1.0} and list(best) == ["a", "b"]


def _cpu_trace(folder, steps: int):
    """(the trace file of ``steps`` calls of a jitted 384^3 matmul beside a doubling of 8
    numbers, the compiled program's HLO text)."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x, w, y: (x @ w, y * 2))
    args = (jnp.ones((384, 384)), jnp.ones((384, 384)), jnp.ones(8))
    jax.block_until_ready(f(*args))
    with jax.profiler.trace(str(folder)):
        for _ in range(steps):
            jax.block_until_ready(f(*args))
    [trace] = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)
    return trace, f.lower(*args).compile().as_text()


def test_a_cpu_trace_gives_the_instructions_and_their_times(tmp_path):
    """On CPU there is no device process: the kernels are XLA's thunks, each named by the HLO
    instruction it runs (``args.hlo_op``), once a call; the matmul comes first, the host's own
    events (Python, PjRt) are left out, and the table keeps the largest ``top`` with their
    sums against the step it is given."""
    trace, hlo = _cpu_trace(tmp_path, steps=2)
    read, kernels = device_trace.device_kernels(trace, steps=2)
    assert read == "hlo_op" and len(kernels) >= 2
    instructions, computations = step_profile.parse_hlo(hlo)
    assert all(k.hlo_ops == (k.name,) and k.name in instructions for k in kernels)
    assert all(k.calls_per_step == 1 for k in kernels)
    assert not any(k.name.startswith(("$", "PjitFunction")) for k in kernels)
    times = [k.ms_per_step for k in kernels]
    assert times == sorted(times, reverse=True) and times[-1] >= 0 and times[0] > 0
    assert step_profile.categorize(kernels[0].name, instructions, computations) == "matmul"

    table = device_trace.kernel_table(kernels, step_s=0.05, top=1)
    assert [r["name"] for r in table["kernels"]] == [kernels[0].name]
    assert table["kernel_count"] == len(kernels) and table["step_s"] == 0.05
    assert table["kernels_ms_per_step"] == pytest.approx(times[0])
    assert table["all_kernels_ms_per_step"] == pytest.approx(sum(times))
    assert table["kernels"][0]["share"] == pytest.approx(times[0] / 50)
    assert table["all_kernels_share"] == pytest.approx(sum(times) / 50)
    assert device_trace.kernel_table(kernels, None, top=1)["kernels_share"] is None


def _gpu_trace(path) -> str:
    """A hand-written trace as the profiler writes one of two steps on a GPU: the host's
    launch annotations (an ``hlo_op`` too), stream 7's kernels with the ``hlo_op`` that launched
    each, a copy naming none, and xprof's derived 'XLA Ops' line over the same kernels."""
    def ev(pid, tid, name, ts, dur, **args):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name,
                "args": {"correlation_id": str(ts), **args}}
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
             "args": {"name": "Stream #7(Kernel,MemcpyD2D)"}},
            {"ph": "M", "pid": 2, "tid": 100, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    gemm = "nvjet_tst_128x256_64x4_2x1_v_bz_TNT"
    step = [ev(2, 7, gemm, 0, 400, hlo_op="dot.1", hlo_module="jit_step"),
            ev(2, 7, gemm, 400, 100, hlo_op="custom-call.2", hlo_module="jit_step"),
            ev(2, 7, gemm, 500, 100, hlo_op="custom-call.2", hlo_module="jit_step"),
            ev(2, 7, "loop_multiply_fusion", 600, 300, hlo_op="multiply_fusion.3"),
            ev(2, 7, "MemcpyD2D", 900, 50),
            ev(2, 100, "dot.1", 0, 400, hlo_op="dot.1"),
            ev(1, 1, "Thunk:#hlo_op=dot.1#", 0, 5, hlo_op="dot.1")]
    events = meta + step + [{**e, "ts": e["ts"] + 2000} for e in step]
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)
    return str(path)


def test_a_gpu_trace_gives_the_stream_kernels_with_the_ops_that_launched_them(tmp_path):
    read, kernels = device_trace.device_kernels(_gpu_trace(tmp_path / "t.trace.json.gz"), 2)
    assert read == "device"
    assert [(k.name, k.ms_per_step, k.calls_per_step, k.hlo_ops) for k in kernels] == [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_TNT", 0.6, 3, ("dot.1", "custom-call.2")),
        ("loop_multiply_fusion", 0.3, 1, ("multiply_fusion.3",)),
        ("MemcpyD2D", 0.05, 1, ())]
    table = device_trace.kernel_table(kernels, step_s=0.001, top=2)
    assert table["kernels_ms_per_step"] == pytest.approx(0.9)
    assert table["all_kernels_share"] == pytest.approx(0.95)
    assert [r["hlo_ops"] for r in table["kernels"]] == [["dot.1", "custom-call.2"],
                                                       ["multiply_fusion.3"]]


def test_the_accelerator_prints_each_kernel_table_as_markdown(tmp_path):
    from benchmarks.accelerator import kernel_table_markdown

    _, kernels = device_trace.device_kernels(_gpu_trace(tmp_path / "t.trace.json.gz"), 2)
    rows = [{"variant": "moe-s", "profile": {"steps": 2, "events": "device",
                                             **device_trace.kernel_table(kernels, 0.001, 2)}},
            {"variant": "dag-s L2", "profile": {"error": "RuntimeError: no CUPTI"}},
            {"variant": "moe-l", "s_per_step": 0.4},                      # not profiled
            {"variant": "moe-l cap", "error": "out of memory"}]
    text = kernel_table_markdown(rows, ops=1)
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert table == ["| `nvjet_tst_128x256_64x4_2x1_v_bz_TNT` | dot.1 +1 | 0.600 | 3 | 60.0% |",
                     "| `loop_multiply_fusion` | multiply_fusion.3 | 0.300 | 1 | 30.0% |"]
    assert ("**moe-s** (2 steps traced; the device's kernels): step 1.000 ms; the 2 largest of "
            "3 kernels 0.900 ms (90.0% of the step), all kernels 0.950 ms (95.0%)") in text
    assert "**dag-s L2**: no kernel table (RuntimeError: no CUPTI)" in text
    assert "moe-l" not in text
    assert kernel_table_markdown(rows[2:]) == ""


def test_a_failed_profile_is_one_line_and_leaves_the_profiler_stopped():
    """accelerator.profile_kernels: a step that raises under the profiler costs the table only
    (its error in one line); the profiler is stopped, so the next variant's trace starts."""
    from benchmarks.accelerator import profile_kernels

    def fails():
        raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES\nsecond line")
    assert profile_kernels(fails, 2, 0.01) == {
        "error": "RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"}
    import jax.numpy as jnp
    got = profile_kernels(lambda: (jnp.ones(64) * 3).block_until_ready(), 2, 0.01, top=1)
    assert "error" not in got and got["steps"] == 2 and len(got["kernels"]) == 1


def test_a_child_that_dies_in_its_profile_keeps_its_timed_row(monkeypatch):
    """run_one_in_subprocess: the child prints its timed row before profiling; a profiler that
    takes the process down leaves that row, with why it has no kernel table; a child that
    dies before any row is the variant's failure."""
    import argparse
    from benchmarks import accelerator

    args = argparse.Namespace(vocab=512, batch=2, seq=32, steps=2, micro=True, profile_steps=3,
                              top_kernels=25)
    timed = json.dumps({"variant": "moe-s", "s_per_step": 0.01})
    out = lambda stdout: subprocess.CompletedProcess(  # noqa: E731
        [], -11, stdout, "Fatal Python error: Segmentation fault\n")
    monkeypatch.setattr(accelerator.subprocess, "run", lambda *a, **k: out(timed + "\n"))
    row = accelerator.run_one_in_subprocess("moe-s", args)
    assert row["s_per_step"] == 0.01 and "error" not in row
    assert row["profile"]["error"] == ("the profiled steps ended the process (exit -11): "
                                       "Fatal Python error: Segmentation fault")
    monkeypatch.setattr(accelerator.subprocess, "run", lambda *a, **k: out(""))
    assert accelerator.run_one_in_subprocess("moe-s", args) == {
        "variant": "moe-s", "error": "Fatal Python error: Segmentation fault"}
