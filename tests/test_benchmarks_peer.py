"""benchmarks/peer_throughput.py end to end, in subprocesses: without torch (a clear install hint,
exit status 0, no traceback) and, where torch and transformers are installed, a ``--tiny`` run
whose table and JSON agree.

The subprocesses drop conftest's eight simulated devices from XLA_FLAGS so our side runs on one
CPU device, as the benchmark does when run by hand.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import single_device_env

pytestmark = pytest.mark.slow          # subprocesses of benchmarks/peer_throughput.py

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peer_throughput.py"


def _run(args, cwd, block=None) -> subprocess.CompletedProcess:
    """The script with ``args``; ``block`` names a module made unimportable (None in sys.modules)."""
    prelude = f"sys.modules[{block!r}] = None; " if block else ""
    code = (f"import runpy, sys; {prelude}sys.argv = [{str(SCRIPT)!r}, *{list(args)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=single_device_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("block", ["torch", "transformers"])
def test_without_torch_prints_install_hint_and_exits_0(tmp_path, block):
    proc = _run(["--tiny", "--vocab", "64"], tmp_path, block=block)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "needs torch and transformers" in out
    assert "pip install -r benchmarks/requirements-peer.txt" in out
    assert "Traceback" not in out
    assert "| vocab |" not in out


def test_tiny_run_table_matches_json(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    proc = _run(["--tiny", "--vocab", "64", "--json", "out.json"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "| vocab | ours s/step | ours tok/s | OLMoE s/step | OLMoE tok/s | ours / OLMoE |" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["batch"] == 2 and data["seq"] == 32
    assert set(data["versions"]) == {"jax", "torch", "transformers"}
    (row,) = data["rows"]
    assert row["vocab"] == 64
    for key in ("ours_tok_s", "olmoe_tok_s", "ours_s_per_step", "olmoe_s_per_step"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["olmoe_tok_s"], rel=1e-9)
    assert row["ours_tok_s"] == pytest.approx(2 * 32 / row["ours_s_per_step"], rel=1e-9)
    table_row = next(line for line in out.splitlines() if line.startswith("| 64 |"))
    cells = [c.strip() for c in table_row.strip("|").split("|")]
    assert cells[-1] == f"{row['ratio']:.2f}x"
    assert float(cells[2].replace(",", "")) == pytest.approx(row["ours_tok_s"], abs=0.5)
    assert float(cells[4].replace(",", "")) == pytest.approx(row["olmoe_tok_s"], abs=0.5)
    # same shapes by construction: the parameter counts differ only by OLMoE's q/k RMSNorm scales
    assert row["olmoe_params"] - row["ours_params"] == 2 * (64 + 2 * 16)
    assert "= its q/k RMSNorm scales" in out


def test_olmoe_under_the_system_malloc_runs_in_a_child_process(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    proc = _run(["--tiny", "--vocab", "64", "--olmoe_system_malloc", "--json", "out.json"],
                tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "OLMoE, system malloc, s/step | ours / that |" in out
    (row,) = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert math.isfinite(row["olmoe_system_s_per_step"]) and row["olmoe_system_s_per_step"] > 0
    assert row["ratio_system"] == pytest.approx(row["olmoe_system_s_per_step"]
                                                / row["ours_s_per_step"], rel=1e-9)
    table_row = next(line for line in out.splitlines() if line.startswith("| 64 |"))
    assert table_row.rstrip(" |").endswith(f"{row['ratio_system']:.2f}x")
