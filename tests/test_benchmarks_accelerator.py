"""benchmarks/accelerator.py end to end at its micro size on CPU, so that the one command
meant for a lent GPU works the day one is lent: every variant measured in its own process, the
table, the DAG / shared ratio from the measured times, the quality run and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import single_device_env

pytestmark = pytest.mark.slow          # subprocesses of benchmarks/accelerator.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from accelerator import VARIANTS, datasheet_peak  # noqa: E402


def test_datasheet_peaks_match_device_kinds():
    assert datasheet_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert datasheet_peak("NVIDIA H100 PCIe") == 756e12           # not the SXM part's
    assert datasheet_peak("NVIDIA A100-SXM4-40GB") == 312e12
    assert datasheet_peak("TPU v5 lite") == 197e12
    assert datasheet_peak("cpu") is None


def test_the_accelerator_script_runs_at_micro_size(tmp_path, stdlib_corpus):
    env = single_device_env()
    out_json = tmp_path / "out" / "accelerator.json"
    # the quality run's corpus, built once for the run (conftest.stdlib_corpus)
    stdlib_corpus(out_json.parent / "accelerator_runs" / "corpus")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "accelerator.py"), "--micro",
           "--variants", "moe+shared-s", "dag-s L2", "--json", str(out_json)]
    out = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=900,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in report["variants"]}
    assert set(rows) == {"moe+shared-s", "dag-s L2"} and set(rows) <= set(VARIANTS)
    for row in rows.values():
        assert "error" not in row, row
        assert row["s_per_step"] > 0 and row["tokens_per_s"] == pytest.approx(
            2 * 32 / row["s_per_step"])
    ratio = rows["dag-s L2"]["s_per_step"] / rows["moe+shared-s"]["s_per_step"]
    assert report["dag_over_shared_step_ratio"] == pytest.approx(ratio)
    assert f"{ratio:.4f}x" in out.stdout
    table = [line for line in out.stdout.splitlines()
             if line.startswith(("moe+shared-s ", "dag-s L2 ")) and " / " not in line]
    assert len(table) == 2 and all(f"{rows[name]['params']:,}" in line
                                   for name, line in zip(("moe+shared-s", "dag-s L2"), table))
    quality = {r["variant"]: r for r in report["quality"]["runs"]}
    assert set(quality) == {"moe", "moe_shared", "dag_l2"}
    assert all(0 < r["loss"] < 10 for r in quality.values())
