"""benchmarks/checkouts.py: the rotating order, the per-round ratios, a bad side in one line,
and a --tiny run of two sides (this checkout twice) in child processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import checkouts
from conftest import REPO, benchmark_command, repository_importable, single_device_env


def test_order_rotates_and_alternates():
    assert [checkouts.order(r, 3) for r in range(4)] == [[0, 1, 2], [0, 2, 1], [2, 0, 1],
                                                         [2, 1, 0]]
    # over 2n rounds every side starts a round and ends one
    firsts = {checkouts.order(r, 3)[0] for r in range(6)}
    lasts = {checkouts.order(r, 3)[-1] for r in range(6)}
    assert firsts == lasts == {0, 1, 2}


def test_summary_pairs_each_round_with_the_first_side():
    rows = checkouts.summary(["a", "b"], {"a": [1.0, 2.0, 1.5], "b": [1.1, 1.8, 1.5]})
    a, b = rows
    assert a["ratio"] == 1.0 and a["median"] == 1.5
    assert b["median"] == 1.5 and b["low"] == 1.1 and b["high"] == 1.8
    assert b["ratio"] == pytest.approx(1.0) and b["ratio_low"] == pytest.approx(0.9)
    assert b["ratio_high"] == pytest.approx(1.1)
    assert "| b |" in checkouts.table(rows, {"a": "jax 1", "b": "jax 2"})


def test_a_side_that_is_not_a_checkout_is_one_line(tmp_path):
    proc = subprocess.run([*benchmark_command("checkouts"), "--side", f"x={tmp_path}",
                           "--side", "y=."], cwd=REPO, capture_output=True, text=True,
                          env=repository_importable(single_device_env()), timeout=120)
    assert proc.returncode == 2
    assert "no benchmarks/peer_throughput.py" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_two_sides_run_in_children_and_print_the_table(tmp_path):
    proc = subprocess.run([*benchmark_command("checkouts"), "--side", "one=.", "--side",
                           f"two=.:{sys.executable}", "--rounds", "2", "--steps", "1",
                           "--tiny", "--vocab", "64"], cwd=REPO, capture_output=True,
                          text=True, env=repository_importable(single_device_env()),
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("round 0:") == 2 and out.count("round 1:") == 2
    assert "| one | Python 3." in out and "jax " in out
    assert "| two |" in out and "1.000x" in out
