"""Every command holds at the keyboard (issue 69): SIGINT to its process group, as Ctrl-C
sends it, at several moments of each command (the import window, start-up, mid-work, just
before the end), each moment's outcome checked by the stop contract of
:mod:`dagmoe_jax.stopping`: exit 130 with one line and nothing it writes left behind, or exit 0
with its output complete; never a traceback, an abort, or a "done" line with exit 130
(``scripts/signal_sweep.py --command``; train.py's own sweep is tests/test_reliability.py's).
And the contract itself, in a child: a signal during a long library call is acted on at once
(by the stop thread), what was registered is removed, a signal once the output is complete is
ignored."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import build_once, single_device_env
from dagmoe_jax.stopping import QUIET_DEADLINE_S

REPO = Path(__file__).resolve().parent.parent
SWEEP = REPO / "scripts" / "signal_sweep.py"
sys.path.insert(0, str(REPO / "scripts"))
signal_sweep = importlib.import_module("signal_sweep")


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory) -> str:
    """The commands' inputs (a smoke run, a Mixtral and a Llama folder, an imported run, a
    corpus), made once for every worker."""
    return build_once(tmp_path_factory, "signal_fixtures",
                      lambda d: str(signal_sweep.make_fixtures(Path(d))))


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(signal_sweep.COMMANDS))
def test_a_signal_at_any_moment_of_a_command_is_one_clean_stop(command, fixtures, tmp_path):
    out = tmp_path / "verdicts.json"
    result = subprocess.run([sys.executable, str(SWEEP), f"--command={command}",
                             f"--fixtures={fixtures}", "--parallel=2", f"--json={out}"],
                            capture_output=True, text=True, env=single_device_env(),
                            cwd=REPO, timeout=900)
    verdicts = json.loads(out.read_text())
    assert result.returncode == 0 and all(v["clean"] for v in verdicts), result.stdout
    assert len(verdicts) == 5, result.stdout
    # the first moment is the import window: stopped; the whole run was complete (exit 0)
    assert verdicts[0]["code"] == 130, result.stdout
    assert verdicts[0]["delay"] == signal_sweep.IMPORT_WINDOW, result.stdout


def test_the_command_modules_load_no_library_before_the_stop_handlers():
    """A command's module (and its package, which ``python -m`` imports first) loads neither
    NumPy nor JAX: they load after the handlers are installed, where a signal is one line."""
    modules = [m for m, *_ in signal_sweep.COMMANDS.values()] + [
        "dagmoe_jax.cli.train", "dagmoe_jax.cli.entry", "dagmoe_jax.harness.cli"]
    code = ("import sys, importlib\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m if m.count('.') > 1 or m.endswith('command') "
            "else m + '.__main__')\n"
            "print('numpy' in sys.modules, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env=single_device_env(), timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


CONTRACT = textwrap.dedent("""
    import ctypes, os, signal, sys, threading, time, traceback
    from pathlib import Path
    from dagmoe_jax import stopping
    out, kept = Path(sys.argv[1]), Path(sys.argv[2])
    mode = sys.argv[3]
    def main():
        stopping.set_stop_message(f"nothing was written at {out}")
        stopping.remove_on_stop(out, threaded=mode == "threaded")
        if mode == "threaded":      # a save's thread that writes on after the signal
            (out / "sub").mkdir(parents=True)
            def writer():
                for _ in range(20):
                    try:
                        (out / "sub" / "late").write_text("x")
                    except OSError:     # removed under it: its traceback, as Orbax's threads
                        traceback.print_exc()
                    out.mkdir(exist_ok=True)
                    (out / "late").write_text("x")
                    time.sleep(0.02)
            threading.Thread(target=writer, daemon=True).start()
        stopping.remove_on_stop(kept)           # existed: what appears in it goes
        out.mkdir(exist_ok=True)
        (out / "half").write_text("x")
        (kept / "new").write_text("x")
        if mode == "complete":
            stopping.output_complete()
            print("done", flush=True)
        if mode == "threaded":      # the main thread acts: the write's output goes for good
            os.kill(os.getpid(), signal.SIGINT)
        # a long library call that checks no signals (an XLA compilation): the main thread
        # sleeps in C with the signal blocked there, so only the stop thread can act on it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)
        ctypes.CDLL(None).sleep(5)
        print("after the call", flush=True)
        return 0
    sys.exit(stopping.run_command(main))
""")


@pytest.mark.parametrize("mode", ["working", "threaded", "complete"])
def test_the_stop_contract(mode, tmp_path):
    out, kept = tmp_path / "out", tmp_path / "kept"
    kept.mkdir()
    (kept / "mine").write_text("keep")
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-c", CONTRACT, str(out), str(kept), mode],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    took = time.monotonic() - began
    if mode in ("working", "threaded"):
        # threaded: the removal repeats until the output has been quiet for QUIET_S, at most
        # QUIET_DEADLINE_S (under a loaded machine the write's thread keeps it busy for longer)
        bound = 4 if mode == "working" else 2 + QUIET_DEADLINE_S
        assert result.returncode == 130 and took < bound, (result, took)
        assert result.stderr.strip().splitlines() == [
            f"error: SIGINT received: nothing was written at {out}"], result.stderr
        assert not out.exists() and sorted(p.name for p in kept.iterdir()) == ["mine"]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    else:                                   # complete: the signal is ignored, exit 0
        assert result.returncode == 0 and result.stdout.split("\n")[:2] == [
            "done", "after the call"], result
        assert result.stderr == "" and (out / "half").is_file()


def test_the_stop_line_starts_a_line_of_its_own_under_a_progress_bar(tmp_path):
    """lm-eval's tqdm bars leave the cursor at the end of their line: the stop line follows
    on the next one, and without a bar no empty line comes before it."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from dagmoe_jax import stopping
        def main():
            stopping.set_stop_message("stopped")
            if sys.argv[1] == "bar":
                from tqdm import tqdm
                bar = tqdm(total=10, desc="Running requests")
                bar.update(3)
            else:
                print("working", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            return 0
        sys.exit(stopping.run_command(main))
    """)
    for mode in ("bar", "plain"):
        result = subprocess.run([sys.executable, "-c", code, mode], capture_output=True,
                                text=True, cwd=REPO, timeout=60)
        lines = result.stderr.replace("\r", "\n").split("\n")
        assert result.returncode == 130 and lines[-2:] == [
            "error: SIGINT received: stopped", ""], result.stderr
        assert lines[-3] != "" and ("Running requests" in lines[-3]) == (mode == "bar"), lines


def test_a_command_called_from_python_keeps_pythons_own_handling():
    """``main()`` of a command called from Python without the contract (a notebook): a
    signal before training begins is the one line and exit status 130 returned, and the
    process lives on (the contract's stop, which ends a command's process, is not installed)."""
    code = textwrap.dedent("""
        import os, signal, sys, threading, time
        from dagmoe_jax.cli import train
        default = signal.getsignal(signal.SIGINT)
        def interrupt():            # once the command's own handler is in place (start-up)
            while signal.getsignal(signal.SIGINT) is default:
                time.sleep(0.01)
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        code = train.main(["--run_dir=" + sys.argv[1], "--no_progress"])
        print("returned", code, flush=True)
    """)
    run_dir = Path(tempfile.mkdtemp()) / "run"
    result = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True,
                            text=True, cwd=REPO, env=single_device_env(), timeout=300)
    assert result.returncode == 0, result
    assert result.stdout.strip().splitlines()[-1] == "returned 130", result
    assert "received before training began" in result.stderr and not run_dir.exists()
