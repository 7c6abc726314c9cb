"""benchmarks/step_throughput.py end to end on a micro model: its table, and --rounds putting
each variant at both ends of the run."""

from __future__ import annotations

import subprocess

import pytest

from conftest import benchmark_command, single_device_env

pytestmark = pytest.mark.slow          # a subprocess of benchmarks/step_throughput.py

MICRO = ["ModelConfig.num_layers = 1", "ModelConfig.d_model = 64", "ModelConfig.num_heads = 4",
         "ModelConfig.num_kv_heads = 2", "ExpertConfig.num_experts = 4",
         "ExpertConfig.expert_hidden = 32", "ExpertConfig.shared_hidden = 32",
         "AggregationConfig.dag_dim = 16"]


def test_step_throughput_rounds_alternate_and_keep_the_best():
    env = single_device_env(DAGMOE_TCMALLOC="0")
    cmd = benchmark_command("step_throughput", "--vocab", "256", "--batch", "2", "--seq", "32",
                            "--steps", "1", "--rounds", "2", "--variants", "moe+shared",
                            "dag L2")
    for b in MICRO:
        cmd += ["--binding", b]
    out = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = [line.split()[1] + " " + line.split(",")[1].split(":")[0].strip()
                for line in out.stdout.splitlines() if line.strip().startswith("measured")]
    # Round 2 runs the variants in reverse order.
    assert measured == ["moe+shared round 1", "dag round 1", "dag round 2",
                        "moe+shared round 2"]
    times = {}
    for line in out.stdout.splitlines():
        if line.strip().startswith("measured"):
            name = line.split()[1]
            times.setdefault(name, []).append(float(line.split(":")[1].split()[0]))
    table = {line.split()[0]: line.split() for line in out.stdout.splitlines()
             if line.startswith(("moe+shared ", "dag L2 "))}
    # The table keeps each variant's best round, and the ratio is computed from those.
    assert float(table["moe+shared"][1].replace(",", "")) > 0
    assert abs(float(table["moe+shared"][2]) - min(times["moe+shared"])) < 1e-3
    assert abs(float(table["dag"][3]) - min(times["dag"])) < 1e-3
    ratio = float(table["dag"][-1].rstrip("x"))
    d, m, half = min(times["dag"]), min(times["moe+shared"]), 5e-4  # printed to 3 decimals
    assert (d - half) / (m + half) - 1e-3 <= ratio <= (d + half) / (m - half) + 1e-3
    assert "best of 1 timed steps per variant and of 2 rounds" in out.stdout
