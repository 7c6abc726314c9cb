"""The suite's own set-up: a test whose worker crashed runs once more (tests/rerun_crashed.py)."""

import conftest


CRASHING = '''
import os, signal, time
from pathlib import Path

def test_crashes_once():
    marker = Path(__file__).with_name("crashed")
    if not marker.exists():
        marker.write_text("x")
        # as a compile crashes, seconds in: the plugin's worker has told the controller of the
        # test's reruns by then (a kill at once can beat that message and count as a failure)
        time.sleep(2.0)
        os.kill(os.getpid(), signal.SIGSEGV)

def test_fails_plainly():
    tries = Path(__file__).with_name("tries")
    tries.write_text((tries.read_text() if tries.exists() else "") + "x")
    assert False
'''


def test_a_crashed_worker_reruns_its_test_once_and_a_failure_runs_once(tmp_path):
    """tests/rerun_crashed.py: a test whose xdist worker died (XLA:CPU's compile segfault)
    runs once more and passes; a test that fails is not rerun."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_crash.py").write_text(CRASHING)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(conftest.REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
         "-p", "rerun_crashed", "-c", os.devnull, "--rootdir", str(tmp_path),
         str(tmp_path / "test_crash.py")], capture_output=True, text=True, timeout=120, env=env)
    assert "1 failed, 1 passed, 1 rerun" in out.stdout, out.stdout[-800:]
    assert (tmp_path / "tries").read_text() == "x"
