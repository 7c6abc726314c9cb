"""benchmarks/peer_throughput.py end to end, in subprocesses: without torch (a clear install hint,
exit status 0, no traceback) and, where torch and transformers are installed, a ``--tiny`` run
of two rounds: each side's rounds ran in child processes of their own, in alternating order, on
the same token ids, the parent never imported torch, and the table and JSON agree.

The subprocesses drop conftest's eight simulated devices from XLA_FLAGS so our side runs on one
CPU device, as the benchmark does when run by hand.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import repository_importable, single_device_env

pytestmark = pytest.mark.slow          # subprocesses of benchmarks/peer_throughput.py

MODULE = "benchmarks.peer_throughput"
PEER = ("torch", "transformers")


def _run(args, cwd, block=None) -> subprocess.CompletedProcess:
    """``python -m benchmarks.peer_throughput ARGS`` in ``cwd``; ``block`` names a module made
    unimportable (None in sys.modules). On exit the process writes the torch / transformers
    modules it had loaded to ``cwd/parent_modules.json``."""
    prelude = f"sys.modules[{block!r}] = None; " if block else ""
    record = (f"atexit.register(lambda: open('parent_modules.json', 'w').write(json.dumps("
              f"sorted(m for m in sys.modules if m.split('.')[0] in {PEER!r} "
              f"and sys.modules[m] is not None)))); ")
    code = (f"import atexit, json, runpy, sys; {prelude}{record}"
            f"sys.argv = [{MODULE!r}, *{list(args)!r}]; "
            f"runpy.run_module({MODULE!r}, run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd,
                          env=repository_importable(single_device_env()),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("block", PEER)
def test_without_torch_prints_install_hint_and_exits_0(tmp_path, block):
    proc = _run(["--tiny", "--vocab", "64"], tmp_path, block=block)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "needs torch and transformers" in out
    assert "pip install -r benchmarks/requirements-peer.txt" in out
    assert "Traceback" not in out
    assert "| vocab |" not in out
    assert json.loads((tmp_path / "parent_modules.json").read_text()) == []


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(stdout + stderr, JSON) of a --tiny run of two rounds, OLMoE under the system malloc."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("peer")
    proc = _run(["--tiny", "--vocab", "64", "--rounds", "2", "--olmoe_system_malloc",
                 "--json", "out.json"], tmp)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    data = json.loads((tmp / "out.json").read_text())
    data["parent_modules"] = json.loads((tmp / "parent_modules.json").read_text())
    return out, data


def test_each_side_runs_in_its_own_process_in_alternating_rounds(tiny_run):
    _, data = tiny_run
    assert data["parent_modules"] == [], "the parent process imported torch or transformers"
    runs = data["runs"]
    assert [(r["round"], r["side"]) for r in runs] == [
        (0, "ours"), (0, "olmoe"), (1, "olmoe"), (1, "ours")]
    pids = [r["pid"] for r in runs]
    assert len(set(pids)) == len(runs) and data["parent_pid"] not in pids
    assert all(r["ppid"] == data["parent_pid"] for r in runs)
    # one child at a time: each ended before the next started
    assert all(a["end"] <= b["start"] for a, b in zip(runs, runs[1:]))
    assert not any(r["torch_loaded"] for r in runs if r["side"] == "ours")
    # the same token ids on both sides
    assert len({r["tokens_sha256"] for r in runs}) == 1
    assert data["rows"][0]["tokens_sha256"] == runs[0]["tokens_sha256"]
    # each side keeps its best round
    (row,) = data["rows"]
    for side in ("ours", "olmoe"):
        times = [r["s_per_step"] for r in runs if r["side"] == side]
        assert row[f"{side}_s_per_step"] == min(times)
        assert data["sides"][side]["pids"] == [r["pid"] for r in runs if r["side"] == side]


def test_versions_allocators_and_threads_are_reported(tiny_run):
    out, data = tiny_run
    assert set(data["versions"]) == {"jax", "jaxlib", "torch", "transformers"}
    assert "| side | versions | allocator | threads (as its child saw them) |" in out
    ours_line = next(line for line in out.splitlines() if line.startswith("| ours |"))
    olmoe_line = next(line for line in out.splitlines() if line.startswith("| OLMoE |"))
    for name in ("jax", "jaxlib"):
        assert f"{name} {data['versions'][name]}" in ours_line
    for name in ("torch", "transformers"):
        assert f"{name} {data['versions'][name]}" in olmoe_line
    # --olmoe_system_malloc: OLMoE's child runs without our allocator set-up, ours with it
    assert data["sides"]["olmoe"]["allocator"] == ["system malloc"]
    assert data["sides"]["ours"]["allocator"] != ["system malloc"]
    assert "| system malloc |" in olmoe_line
    for r in data["runs"]:
        t = r["threads"]
        assert t["cpus"] >= 1 and t["os_threads"] >= 1
        if r["side"] == "olmoe":
            assert t["torch_threads"] >= 1
            assert f"torch {t['torch_threads']} intra-op" in olmoe_line
        else:
            assert f"XLA {t['xla_threads']} threads" in ours_line
    for line in (ours_line, olmoe_line):
        assert "OMP_NUM_THREADS" in line and "OMP_WAIT_POLICY" in line


def test_table_matches_json(tiny_run):
    out, data = tiny_run
    assert data["batch"] == 2 and data["seq"] == 32
    assert ("| vocab | ours s/step | ours tok/s | OLMoE s/step | OLMoE tok/s | ours / OLMoE |"
            in out)
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
