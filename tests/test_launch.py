"""dagmoe_jax.run.allocator: when the entry points re-execute themselves with TCMalloc preloaded."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import benchmark_command
from dagmoe_jax.run.allocator import (GLIBC_SWITCH, GLIBC_TUNED, SWITCH, allocator, find_tcmalloc,
                                      tcmalloc_environment)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def libdir(tmp_path):
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    return str(tmp_path)


def test_find_tcmalloc_searches_the_given_dirs(tmp_path, libdir):
    assert find_tcmalloc([str(tmp_path / "missing"), libdir]) == os.path.join(
        libdir, "libtcmalloc_minimal.so.4")
    assert find_tcmalloc([str(tmp_path / "missing")]) is None


def test_environment_prepends_the_library_to_ld_preload(libdir):
    lib = os.path.join(libdir, "libtcmalloc_minimal.so.4")
    env = tcmalloc_environment({"PATH": "/bin"}, "linux", [libdir])
    assert env == {"PATH": "/bin", "LD_PRELOAD": lib}
    env = tcmalloc_environment({"LD_PRELOAD": "/x/libfoo.so"}, "linux", [libdir])
    assert env["LD_PRELOAD"] == f"{lib} /x/libfoo.so"


def test_environment_leaves_the_process_alone(tmp_path, libdir):
    lib = os.path.join(libdir, "libtcmalloc_minimal.so.4")
    assert tcmalloc_environment({}, "darwin", [libdir]) is None             # not Linux
    assert tcmalloc_environment({SWITCH: "0"}, "linux", [libdir]) is None   # switched off
    assert tcmalloc_environment({}, "linux", [str(tmp_path / "none")]) is None  # not installed
    assert tcmalloc_environment({"LD_PRELOAD": f"/a.so:{lib}"}, "linux", [libdir]) is None
    assert tcmalloc_environment({SWITCH: str(tmp_path / "nope.so")}, "linux", [libdir]) is None


def test_switch_1_searches_like_unset(libdir):
    env = tcmalloc_environment({SWITCH: "1"}, "linux", [libdir])
    assert env["LD_PRELOAD"] == os.path.join(libdir, "libtcmalloc_minimal.so.4")


def test_switch_names_the_library(tmp_path):
    other = tmp_path / "libother.so"
    other.write_bytes(b"")
    env = tcmalloc_environment({SWITCH: str(other)}, "linux", [])
    assert env["LD_PRELOAD"] == str(other)


def test_allocator_names_what_is_preloaded(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    assert allocator().startswith("tcmalloc")
    monkeypatch.delenv("LD_PRELOAD")
    assert allocator() == "system malloc"


SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
print("start", os.getpid(), os.environ.get("LD_PRELOAD", ""), flush=True)
from dagmoe_jax.run.allocator import reexec_with_tcmalloc
reexec_with_tcmalloc()
print("after", os.getpid(), sys.argv[1:], flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux-only")
def test_reexec_restarts_once_with_the_same_pid_and_arguments(tmp_path):
    # Any loadable shared library stands in for TCMalloc: the C math library is everywhere.
    libm = ctypes.util.find_library("m")
    path = next((os.path.join(d, libm) for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
                                                   "/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64")
                 if libm and os.path.isfile(os.path.join(d, libm))), None)
    assert path, "no libm to preload"
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env[SWITCH] = path
    out = subprocess.run([sys.executable, str(script), "--flag", "x"], env=env, text=True,
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["start", "start", "after"], lines
    pids = {line.split()[1] for line in lines}
    assert len(pids) == 1                                # exec, not a child process
    assert lines[0].split()[2:] == [] and lines[1].split()[2] == path
    assert lines[2].endswith("['--flag', 'x']")
    env[SWITCH] = "0"
    out = subprocess.run([sys.executable, str(script)], env=env, text=True, capture_output=True,
                         timeout=60)
    assert [line.split()[0] for line in out.stdout.splitlines()] == ["start", "after"]


@pytest.mark.slow
def test_alloc_bandwidth_benchmark_prints_its_table():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env[SWITCH] = env[GLIBC_SWITCH] = "0"
    out = subprocess.run(benchmark_command("alloc_bandwidth", "--mb", "1", "2", "--repeats", "1"),
                         env=env, text=True, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "allocator: system malloc" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "MB |" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["1 MB", "2 MB"]
    assert all(float(r.split("|")[2]) > 0 and float(r.split("|")[3]) > 0 for r in rows)


FAULTS = """
import resource, sys
sys.path.insert(0, {root!r})
from dagmoe_jax.run.allocator import configure_allocator
print(configure_allocator(), flush=True)
import jax, jax.numpy as jnp
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
f = jax.jit(lambda x: x * 2 + 1)
x = jnp.ones(1 << 24, jnp.float32)
for _ in range(20):  # compile, and let the heap grow to its working size (about 7 calls)
    f(x).block_until_ready()
before = faults()
for _ in range(10):
    f(x).block_until_ready()  # a fresh 64 MB output buffer each call, freed
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
@pytest.mark.parametrize("tune", ["1", "0"])
def test_tuned_glibc_reuses_freed_memory_without_page_faults(tmp_path, tune):
    """Without TCMalloc, configure_allocator tunes glibc so that XLA's freed 64 MB output buffer
    is reused; switched off, glibc unmaps it and every call faults its 16,384 pages in again.
    Buffers are freed asynchronously, so under load the tuned heap may still grow by a buffer
    now and then (4 of 10 calls seen in a full suite run on 2 cores): at most 5 of the 10
    calls may fault, against all 10 untuned."""
    script = tmp_path / "faults.py"
    script.write_text(FAULTS.format(root=str(ROOT)))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "XLA_FLAGS")}
    env[SWITCH], env[GLIBC_SWITCH] = "0", tune
    out = subprocess.run([sys.executable, str(script)], env=env, text=True, capture_output=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    name, faults = out.stdout.splitlines()
    if tune == "1":
        assert name == GLIBC_TUNED
        assert int(faults) < 5 * 16384 + 1000
    else:
        assert name == "system malloc"
        assert int(faults) > 10 * 16384 * 0.9


TRIM = """
import ctypes, resource, sys
sys.path.insert(0, {root!r})
from dagmoe_jax.run.allocator import tune_glibc_malloc
assert tune_glibc_malloc()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = (2 << 30) + (256 << 20)           # over 2^31 - 1, the largest trim threshold an int sets
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    block = libc.malloc(size)
    before = faults()
    ctypes.memset(block, 1, size)
    touched = faults() - before
    libc.free(block)                      # the heap's top: trimmed unless trimming is off
print(touched)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_tuned_glibc_never_trims_even_over_two_gigabytes(tmp_path):
    """A step whose temporaries free more than 2 GB at the heap's top (DAG-MoE-s at L 3) had
    that memory handed back and faulted in again every step: the largest threshold an int can
    set is 2^31 - 1. Tuned, glibc never trims: the second 2.25 GB block faults nothing in."""
    script = tmp_path / "trim.py"
    script.write_text(TRIM.format(root=str(ROOT)))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, str(script)], env=env, text=True, capture_output=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) < 1000          # 589,824 pages if the heap were trimmed


# Run by the entries' tests below: the command's module replaced by a stub whose entry_main
# reports how many malloc arenas the process has (glibc's malloc_info: one <heap> per arena).
ARENAS_STUB = r"""
import ctypes, os, re, sys, types
def arenas():
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    path = sys.argv[1] + ".xml"
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    return len(re.findall(r'<heap nr=', open(path).read()))
def entry_main():                        # as the real one: the allocator set up, then main
    import threading
    from dagmoe_jax.run.allocator import allocator, configure_allocator
    configure_allocator()
    threads = sorted(t.name for t in threading.enumerate())
    print(f"arenas={arenas()} allocator={allocator()} threads={threads}", flush=True)
    return 0
stub = types.ModuleType("dagmoe_jax.cli.train")
stub.entry_main = stub.main = entry_main
sys.modules["dagmoe_jax.cli.train"] = stub
"""


@pytest.mark.parametrize("entry", ["train.py", "dagmoe-train", "python -m dagmoe_jax.cli.train"])
def test_train_entries_tune_the_allocator_before_the_stop_watcher_starts(tmp_path, entry):
    """The contract's watcher thread, started before glibc's one-arena tuning, kept an arena of
    its own that glibc then shared out to XLA's threads: README's `python train.py` page-faulted
    22,000-36,000 times a step (under 1,000 with the allocator set up first)."""
    run = {"train.py": "import runpy; runpy.run_path('train.py', run_name='__main__')",
           "dagmoe-train": "from dagmoe_jax.cli import entry; sys.exit(entry.command('dagmoe-train'))",
           # the real module's entry() and entry_main, the stub's main
           "python -m dagmoe_jax.cli.train": ("del sys.modules['dagmoe_jax.cli.train']; "
                                              "import dagmoe_jax.cli.train as real; "
                                              "real.main = lambda: stub.entry_main(); "
                                              "sys.exit(real.entry())")}[entry]
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, GLIBC_SWITCH)}
    env[SWITCH] = "0"                                  # glibc tuned, not TCMalloc
    proc = subprocess.run([sys.executable, "-c", ARENAS_STUB + run, str(tmp_path / "info")],
                          cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("arenas="))
    assert "dagmoe-stop" in line                       # the watcher thread is running
    assert f"allocator={GLIBC_TUNED}" in line
    assert line.startswith("arenas=1 "), line
