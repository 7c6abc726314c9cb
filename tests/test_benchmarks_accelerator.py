"""benchmarks/accelerator.py end to end at its micro size on CPU, so that the one command
meant for a lent GPU works the day one is lent: every variant measured in its own process, the
table, the DAG / shared ratio from the measured times, each variant's kernel table from a trace
of its step (tests/test_benchmarks_profile.py checks the tables themselves), the quality run
and the JSON."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from benchmarks.accelerator import VARIANTS, datasheet_peak
from conftest import benchmark_command, repository_importable, single_device_env

pytestmark = pytest.mark.slow          # subprocesses of benchmarks/accelerator.py


def test_datasheet_peaks_match_device_kinds():
    assert datasheet_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert datasheet_peak("NVIDIA H100 PCIe") == 756e12           # not the SXM part's
    assert datasheet_peak("NVIDIA A100-SXM4-40GB") == 312e12
    assert datasheet_peak("TPU v5 lite") == 197e12
    assert datasheet_peak("cpu") is None


def test_the_triton_variant_binds_the_dag_kernels():
    """'dag-s L2 triton' is 'dag-s L2' with the DAG module's Triton kernels, measured beside
    XLA's module that 'auto' settles to on a GPU; every DAG-MoE variant has its parity
    baseline (MoE + shared) among the variants."""
    from benchmarks.accelerator import RATIOS, variant_config
    cfg, execution = variant_config("dag-s L2 triton", 512, micro=True)
    assert execution.dag_module == "triton"
    assert variant_config("dag-s L2", 512, micro=True) == (cfg, dataclasses.replace(
        execution, dag_module="auto"))
    assert {d for d, _ in RATIOS} == {v for v in VARIANTS if v.startswith("dag-")} - {
        "dag-s L2 triton"}
    assert all(shared in VARIANTS for _, shared in RATIOS)


def test_a_capacity_variant_is_its_model_with_capacity_dispatch():
    """'moe-s cap' is MoE-s (no shared expert) with capacity dispatch at factor 1.25, the speed
    dropless must match; its dropless twin keeps the 'dropless' default."""
    from benchmarks.accelerator import variant_config
    cap, cap_execution = variant_config("moe-s cap", 512, micro=True)
    dropless, execution = variant_config("moe-s", 512, micro=True)
    assert (cap.block.experts.dispatch, cap.block.experts.capacity_factor) == ("capacity", 1.25)
    assert dropless.block.experts.dispatch == "dropless"
    assert cap.replace(block=dropless.block) == dropless and cap_execution == execution


def test_the_accelerator_script_runs_at_micro_size(tmp_path, stdlib_corpus):
    env = repository_importable(single_device_env())
    out_json = tmp_path / "out" / "accelerator.json"
    # the quality run's corpus, built once for the run (conftest.stdlib_corpus)
    stdlib_corpus(out_json.parent / "accelerator_runs" / "corpus")
    # two variants in their processes ('... cap' differs only in its bindings: tested above)
    cmd = benchmark_command("accelerator", "--micro", "--variants", "moe+shared-s", "dag-s L2",
                            "--quality_seeds", "2", "--profile_steps", "2", "--top_kernels", "5",
                            "--json", str(out_json))
    out = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=900,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in report["variants"]}
    assert set(rows) == {"moe+shared-s", "dag-s L2"} and set(rows) <= set(VARIANTS)
    # the dropless variants' grouped matmul 'auto' (on CPU, the C++ kernel or ragged_dot)
    assert rows["dag-s L2"]["grouped_matmul"] in ("cpu_gmm", "ragged_dot")
    assert all(r["estimate_s"] is None for r in rows.values())     # no GPU card on a CPU
    for row in rows.values():
        assert "error" not in row, row
        assert row["s_per_step"] > 0 and row["tokens_per_s"] == pytest.approx(
            2 * 32 / row["s_per_step"])
    ratio = rows["dag-s L2"]["s_per_step"] / rows["moe+shared-s"]["s_per_step"]
    assert report["dag_over_shared_step_ratio"] == {"dag-s L2": pytest.approx(ratio)}
    assert f"{ratio:.4f}x" in out.stdout
    table = [line for line in out.stdout.splitlines()
             if line.startswith(("moe+shared-s ", "dag-s L2 ")) and " / " not in line]
    assert len(table) == 2 and all(f"{rows[name]['params']:,}" in line
                                   for name, line in zip(("moe+shared-s", "dag-s L2"), table))
    # each variant's kernel table, from a trace of 2 more steps (on CPU, XLA's instructions)
    for name, row in rows.items():
        profile = row["profile"]
        assert (profile["steps"], profile["events"], profile["step_s"]) == (
            2, "hlo_op", row["s_per_step"])
        assert len(profile["kernels"]) == 5 < profile["kernel_count"]
        assert all(k["hlo_ops"] == [k["name"]] and k["calls_per_step"] >= 1
                   for k in profile["kernels"])
        assert 0 < profile["kernels_ms_per_step"] < profile["all_kernels_ms_per_step"]
        printed = out.stdout.split(f"**{name}** (2 steps traced")[1].split("\n\n")[1]
        assert [line.split(" | ")[0] for line in printed.splitlines()[2:]] == [
            f"| `{k['name']}`" for k in profile["kernels"]]
    quality = report["quality"]
    assert quality["seeds_run"] == 2
    assert sorted((r["variant"], r["seed"]) for r in quality["runs"]) == [
        (v, s) for v in ("dag_l2", "moe", "moe_shared") for s in (0, 1)]
    assert all(0 < r["loss"] < 10 for r in quality["runs"])
    assert all(quality["summary"][v]["seeds"] == 2 for v in ("moe", "moe_shared", "dag_l2"))


def test_gpu_check_runs_in_the_interpreters(tmp_path):
    """benchmarks/gpu_check.py --interpret: the on-device numerics check, run by the kernels'
    interpreters on CPU at a tiny shape (the Mosaic GPU kernels where this jax interprets
    their backward pass), the DAG iteration's Triton kernels included."""
    out_json = tmp_path / "gpu_check.json"
    # --quick, as accelerator.py passes it (it changes only the timing, which interpret skips)
    out = subprocess.run(benchmark_command("gpu_check", "--interpret", "--quick", "--json",
                                           str(out_json)),
                         env=repository_importable(single_device_env()), text=True,
                         capture_output=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    report = json.loads(out_json.read_text())
    checked = {r["kernel"]: r for r in report["numerics"]}
    assert {"triton", "triton dag", "triton dag first+last"} <= set(checked)
    assert all(r["ok"] for r in checked.values())
    assert all(0 < err < 3e-2 for r in checked.values() for err in r["errors"].values())
    assert "triton tiny (512, 128, 128, 4): forward" in out.stdout
    assert "triton dag tiny (64, 4, 64, 16): forward" in out.stdout
    assert "triton dag first+last tiny (64, 4, 64, 16): forward" in out.stdout


def test_gpu_check_quick_times_the_library_tiles_only():
    """accelerator.py's --quick: each kernel's own table beside XLA's; alone, gpu_check.py
    also times the other tiles (about 40 compilations, 5 minutes of an H200)."""
    from benchmarks.gpu_check import candidates
    for name in ("mgpu", "triton"):
        for role in ("forward", "weight_grad"):
            assert candidates(name, role, 512, quick=True) == [("table", None)]
            full = candidates(name, role, 512)
            assert full[0] == ("table", None) and len(full) == 9
