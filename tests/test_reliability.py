"""Nothing a user does to a live or finished run may lose or silently corrupt it: readers leave
a run alone (test_checkpoint.py), a torn metrics line does not block a resume, and a resume
with another model refuses (or, asked to, says so) while data changes are reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dagmoe_jax.run.records import METRICS_FILE, read_metrics
from dagmoe_jax.train.metrics import MetricsWriter
from conftest import single_device_env

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(REPO / "train.py"), "--gin_file=train/smoke.gin", "--no_progress",
         "--gin.RunConfig.tensorboard=False", "--gin.RunConfig.task_eval_examples=0"]
TRAIN_BINDINGS = ["RunConfig.tensorboard = False", "RunConfig.task_eval_examples = 0"]
ENV = single_device_env()


def run(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN, f"--run_dir={run_dir}", *args], capture_output=True,
                          text=True, timeout=300, env=ENV, cwd=run_dir.parent)


def test_a_torn_last_metrics_line_is_dropped_and_others_are_named(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)   # what a resume does
    writer.write(3, {"loss": 1.25})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"^{path} line 2 is not a metrics record .*: fix or "
                                         r"remove that line$"):
        read_metrics(tmp_path)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reliability") / "run"
    result = run(run_dir, "--gin.RunConfig.steps=10")
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.mark.slow
def test_resume_refuses_a_model_change_that_keeps_the_shapes(short_run):
    before = (short_run / "config.json").read_text()
    # a torn metrics line (a crash mid-write) must not block the resume either
    with open(short_run / METRICS_FILE, "a") as f:
        f.write('{"step": 11, "lo')
    result = run(short_run, "--gin.RunConfig.steps=12", "--gin.RouterConfig.top_k=1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the model config differs from the "
                                                   "checkpoint's in ")
    assert "ModelConfig.block.router.top_k 2 -> 1" in lines[0]
    assert "allow_model_change=True" in lines[0]
    assert (short_run / "config.json").read_text() == before            # nothing overwritten

    allowed = run(short_run, "--gin.RunConfig.steps=12", "--gin.RouterConfig.top_k=1",
                  "--gin.RunConfig.allow_model_change=True", "--gin.DataConfig.seed=3")
    assert allowed.returncode == 0, allowed.stderr
    assert ("warning: resuming with a changed model (allow_model_change): "
            "ModelConfig.block.router.top_k 2 -> 1") in allowed.stdout
    assert ("warning: DataConfig.seed 0 -> 3 since the run last started: the data position "
            "restored comes from the earlier pipeline") in allowed.stdout
    assert "resumed from step 10" in allowed.stdout
    saved = json.loads((short_run / "config.json").read_text())["model"]
    assert saved["block"]["router"]["top_k"] == 1
    assert max(r["step"] for r in read_metrics(short_run)) == 12

    done = run(short_run, "--gin.RunConfig.steps=8", "--gin.RouterConfig.top_k=1",
               "--gin.DataConfig.seed=3")
    assert done.returncode == 0, done.stderr
    assert ("warning: the checkpoint is at step 12 and RunConfig.steps=8: nothing left to "
            "train") in done.stdout


@pytest.mark.slow
def test_diverged_parameters_are_never_saved_as_the_last_good_checkpoint(tmp_path):
    """A huge learning rate: the loss of the step that blows the parameters up is still finite
    (it is computed before the update), so the state after it must be checked before saving."""
    import jax.numpy as jnp
    import numpy as np

    from dagmoe_jax.run import load_run

    run_dir = tmp_path / "run"
    result = run(run_dir, "--gin.OptimConfig.learning_rate=30.0", "--gin.OptimConfig.warmup_steps=0",
                 "--gin.RunConfig.save_every=1", "--gin.RunConfig.keep_checkpoints=100",
                 "--gin.RunConfig.eval_every=0")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the parameters after step ")
    bad_step = int(lines[0].split("after step ")[1].split()[0])
    loaded = load_run(run_dir)
    assert 1 <= loaded.step < bad_step
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 32)), jnp.int32)
    logits, _ = loaded.model(tokens)
    assert bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.slow
def test_repeated_signals_wait_for_the_save_they_asked_for(tmp_path):
    """SIGTERM, then SIGTERM and Ctrl-C while the stop's checkpoint is being written: one clean
    stop, the checkpoint it reports is complete on disk, and the run resumes from it."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*TRAIN, f"--run_dir={run_dir}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while not (run_dir / METRICS_FILE).exists() or not read_metrics(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    # more signals over the next second, while the stop's checkpoint is saved and committed
    for extra in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
        time.sleep(0.2)
        if proc.poll() is None:
            proc.send_signal(extra)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    line = next(line for line in out.splitlines() if "received: saved a checkpoint" in line)
    assert line.startswith("SIGTERM received")
    stopped = int(line.split("at step ")[1].split()[0])
    names = os.listdir(run_dir / "checkpoints")
    assert str(stopped) in names and not any("tmp" in name for name in names)
    again = run(run_dir, f"--gin.RunConfig.steps={max(stopped + 2, 10)}")
    assert again.returncode == 0 and f"resumed from step {stopped}" in again.stdout


def test_a_library_error_a_signal_caused_comes_out_as_the_interrupt():
    """A SIGINT that lands inside a library's lock handling can surface as that library's own
    error (CI: Python's threading said 'release unlocked lock' when it hit a thread pool's
    semaphore while the evaluation batches were built): an error raised while handling the
    interrupt leaves the interruptible block as :class:`Interrupted`, chained to that error;
    without a signal an error is itself, and where signals are only recorded it passes
    unchanged, also inside an interruptible block (training within the command's block: a
    real error after a SIGTERM there is not 'stopped before training began'). In a child, so
    that the handler is installed on its main thread."""
    code = """if True:
        import os, signal, time
        from dagmoe_jax.train.signals import Interrupted, on_signals
        def broken_by(sig, interrupt=True):
            flag = {}
            try:
                with on_signals(flag, interrupt=interrupt):
                    try:
                        if sig:
                            os.kill(os.getpid(), sig)
                            time.sleep(1)
                        raise RuntimeError('release unlocked lock')
                    except KeyboardInterrupt:
                        raise RuntimeError('release unlocked lock')
            except BaseException as err:
                return type(err).__name__, type(err.__cause__).__name__, flag.get('signal')
        def after_training_began():
            flag = {}
            try:
                with on_signals(flag, interrupt=True):
                    with on_signals(flag):
                        os.kill(os.getpid(), signal.SIGTERM)
                        time.sleep(1)
                    raise RuntimeError('disk full')
            except BaseException as err:
                return type(err).__name__, flag.get('signal')
        print(broken_by(signal.SIGINT), broken_by(signal.SIGTERM), broken_by(None),
              broken_by(signal.SIGTERM, interrupt=False), after_training_began(), sep='|')
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                         cwd=REPO, timeout=120)
    assert out.stdout.strip().split("|") == [
        "('Interrupted', 'RuntimeError', 'SIGINT')", "('Interrupted', 'RuntimeError', 'SIGTERM')",
        "('RuntimeError', 'NoneType', None)", "('RuntimeError', 'NoneType', 'SIGTERM')",
        "('RuntimeError', 'SIGTERM')"], out.stderr


def test_the_command_ignores_signals_once_it_is_over():
    """After the command returns, SIGTERM / SIGINT are ignored for the interpreter's shutdown:
    Python resets handlers to the default there, and a late SIGTERM (a supervisor repeating
    itself) killed a run that had stopped cleanly with -15. The entry point runs in a child;
    a bad flag makes it return at once."""
    code = ("import signal, sys; from dagmoe_jax.cli.train import entry; "
            "sys.argv = ['train.py', '--no_such_flag']; rc = entry(); "
            "print(rc, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, "
            "signal.getsignal(signal.SIGINT) is signal.SIG_IGN)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                         cwd=REPO, timeout=120)
    assert out.stdout.split() == ["2", "True", "True"], out.stderr


def test_bad_paths_and_files_are_one_line_errors(tmp_path, capsys):
    """Each of these printed a traceback: a run dir under a file or equal to one, a tokenizer
    path that is not a tokenizer, a config.json from another version, a run with no
    checkpoint (sampling and evaluating). The commands' ``main`` run in this process (what
    their console scripts call); test_a_bad_path_through_the_command_line_is_one_line runs one
    through ``python train.py``."""
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.run.gin import load_configs
    from dagmoe_jax.cli.sample import main as sample_main
    from dagmoe_jax.cli.train import main as train_main

    a_file = tmp_path / "a_file"
    a_file.write_text("not a model\n")
    run_dirs = tmp_path / "runs"
    run_dirs.mkdir()
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    run_lib.save_configs(no_ckpt, *load_configs(["train/smoke.gin"], TRAIN_BINDINGS))
    newer = tmp_path / "newer"
    newer.mkdir()
    blob = json.loads((no_ckpt / "config.json").read_text())
    blob["model"]["a_field_from_the_future"] = 1
    (newer / "config.json").write_text(json.dumps(blob))
    train = TRAIN[2:]
    cases = [
        (train_main, train + [f"--run_dir={a_file}/run"], "lies under"),
        (train_main, train + [f"--run_dir={a_file}"], "is a file, not a directory"),
        (train_main, train + [f"--run_dir={run_dirs}/sp",
                              "--gin.DataConfig.tokenizer='sentencepiece'",
                              f"--gin.DataConfig.tokenizer_path='{a_file}'"],
         "is not a SentencePiece model"),
        (train_main, train + [f"--run_dir={run_dirs}/hf", "--gin.DataConfig.tokenizer='hf'",
                              f"--gin.DataConfig.tokenizer_path='{a_file}'"],
         "is not a Hugging Face tokenizer.json"),
        (sample_main, [f"--run_dir={no_ckpt}", "--prompt=a"], "no checkpoint in"),
        (train_main, ["--mode=eval", f"--run_dir={newer}"],
         "is not a config this version of dagmoe_jax can read"),
    ]
    for main, argv, needle in cases:
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err[-2000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], \
            (argv, err[-2000:])
    assert a_file.read_text() == "not a model\n"


@pytest.mark.slow
def test_a_bad_path_through_the_command_line_is_one_line(tmp_path):
    """One of the above through ``python -m dagmoe_jax.cli.sample`` itself (the entry point)."""
    result = subprocess.run([sys.executable, "-m", "dagmoe_jax.cli.sample",
                             f"--run_dir={tmp_path / 'nowhere'}", "--prompt=a"],
                            capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "does not exist" in lines[0], \
        result.stderr[-2000:]


@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_the_failed_save_in_one_line(tmp_path):
    """ENOSPC during a save printed 420 lines and trained 5 more steps past it. A file-size
    limit (writes fail with EFBIG, as on a full disk) lets the configs and metrics through but
    not the checkpoint's arrays: one line naming the step and the OS's reason, exit 2, no step
    trained after the failed save, and no checkpoint step left behind."""
    run_dir = tmp_path / "run"
    limited = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit("
               "resource.RLIMIT_FSIZE, (200_000, 200_000)); os.execv(sys.argv[1], sys.argv[1:])"]
    # no compilation cache: its writes would fail under the limit too (a warning of JAX's own)
    env = {**ENV, "JAX_COMPILATION_CACHE_DIR": ""}
    result = subprocess.run([*limited, *TRAIN, f"--run_dir={run_dir}",
                             "--gin.RunConfig.async_checkpoint=False"], capture_output=True,
                            text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"error: saving checkpoint step 10 in {run_dir / 'checkpoints'} failed ([Errno 27] File "
        f"too large): free space or fix the file system, then run the same command again to "
        f"start over")
    assert max(r["step"] for r in read_metrics(run_dir)) == 10
    assert not [n for n in os.listdir(run_dir / "checkpoints") if n.isdigit()]


def test_a_huge_document_is_read_in_pieces(tmp_path):
    """One enormous line (a 4 MB line took 1.76 GB and 312 s for 10 steps): the text source
    reads it as pieces of at most 64 KiB that put the document back together exactly, EOS
    only after the last one."""
    import numpy as np

    from dagmoe_jax.data import ByteTokenizer
    from dagmoe_jax.data.pipeline import _Encode
    from dagmoe_jax.data.sources import Piece, TextSource

    words = np.random.default_rng(0).choice([b"alpha", b"beta", b"gamma", "délta".encode()],
                                            size=400_000)
    huge = b" ".join(words)                                    # ~2.4 MB, one line
    path = tmp_path / "huge.txt"
    path.write_bytes(b"first doc\r\n\n" + huge + b"\n\nlast doc\n")
    src = TextSource([str(path)])
    texts = [src[i] for i in range(len(src))]
    assert texts[0] == "first doc" and texts[-1] == "last doc"
    pieces = texts[1:-1]
    assert len(pieces) > 30 and all(isinstance(p, Piece) for p in pieces[:-1])
    assert not isinstance(pieces[-1], Piece)
    assert all(len(p.encode()) <= TextSource.MAX_PIECE_BYTES for p in pieces)
    assert "".join(pieces).encode() == huge                    # cut at boundaries, nothing lost
    tok = ByteTokenizer()
    encode = _Encode(tok)
    eos = [int(np.sum(encode(p)["tokens"] == tok.eos_id)) for p in pieces]
    assert eos == [0] * (len(pieces) - 1) + [1]
    # evaluation packs the same way: one EOS per document, not per piece
    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.data.pipeline import eval_batches
    cfg = DataConfig(source=f"text:{path}", eval_source=f"text:{path}", seq_len=256,
                     batch_size=8)
    batches = eval_batches(cfg, tok, max_batches=None)
    assert sum(int(((b["targets"] == tok.eos_id) & b["mask"]).sum()) for b in batches) == 3


@pytest.mark.slow
def test_memory_stays_flat_in_document_length(tmp_path):
    """Peak memory of 20 training batches from a corpus of one 2 MB and one 32 MB line differ
    by far less than the longer document's size would cost if held and tokenized whole."""
    script = tmp_path / "peak.py"
    script.write_text(
        "import resource, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from dagmoe_jax.data import ByteTokenizer, DataConfig\n"
        "from dagmoe_jax.data.pipeline import train_dataset\n"
        "cfg = DataConfig(source='text:' + sys.argv[1], seq_len=64, batch_size=4)\n"
        "it = iter(train_dataset(cfg, ByteTokenizer()))\n"
        "for _ in range(20):\n"
        "    next(it)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    peaks = {}
    for mb in (2, 32):
        path = tmp_path / f"doc{mb}.txt"
        with open(path, "wb") as f:
            for _ in range(mb):
                f.write(b"lorem ipsum dolor sit amet " * 38836)          # ~1 MB, no newline
            f.write(b"\n\na short second document\n")
        out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True,
                             text=True, timeout=300, env=ENV, cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks[mb] = int(out.stdout.strip().splitlines()[-1]) / 1024          # MiB
    assert peaks[32] - peaks[2] < 16, peaks        # whole-document reading: +60 MiB here


def test_process_flags_without_a_coordinator_are_refused(monkeypatch):
    """`--num_processes=2 --process_id=5` without a coordinator ran as one process, exit 0."""
    from dagmoe_jax.parallel.multihost import initialize

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"--process_id=5 is invalid: expected 0 <= process_id "
                                         r"< num_processes=2"):
        initialize("", 2, 5)
    with pytest.raises(ValueError, match=r"--num_processes=2 --process_id=1 without a "
                                         r"coordinator: pass --coordinator_address"):
        initialize("", 2, 1)
    assert initialize("", 1, 0) == "single" and initialize() == "single"


def test_echoes_of_a_failed_checkpoint_read_are_silenced_on_the_command_line(monkeypatch):
    """After a corrupt checkpoint, asyncio, Orbax's threads and TensorStore's callbacks repeated
    the one failure 300-1,600 times on stderr. The command lines drop those echoes, and only
    those: other errors still print."""
    import asyncio
    import logging
    import types

    from dagmoe_jax.command_line import quiet_background_errors

    printed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: printed.append(str(u.exc_value)))
    for name in ("asyncio", "absl"):
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    quiet_background_errors()
    quiet_background_errors()                        # idempotent: one filter, one hook
    assert len(logging.getLogger("asyncio").filters) == 1
    try:
        raise ValueError("OUT_OF_RANGE: Error reading")
    except ValueError:
        err = sys.exc_info()

    def record(name, msg, pathname, exc_info=None):
        return logging.LogRecord(name, logging.ERROR, pathname, 1, msg, None, exc_info)

    asyncio_logger, absl_logger = logging.getLogger("asyncio"), logging.getLogger("absl")
    assert not asyncio_logger.filter(record("asyncio", "Task exception was never retrieved",
                                            asyncio.__file__, err))
    assert not absl_logger.filter(record("absl", "Failed to run 4 Handler Commit operations",
                                         "/site-packages/orbax/checkpoint/x.py", err))
    assert asyncio_logger.filter(record("asyncio", "Exception in callback", asyncio.__file__))
    assert absl_logger.filter(record("absl", "a real error", "/site-packages/flax/x.py"))
    unraisable = types.SimpleNamespace(exc_type=RuntimeError, err_msg=None, object=None,
                                       exc_value=RuntimeError("Event loop is closed"),
                                       exc_traceback=None)
    sys.unraisablehook(unraisable)
    unraisable.exc_value = RuntimeError("something else")
    sys.unraisablehook(unraisable)
    assert printed == ["something else"]


def _children(pid: int) -> list:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process parents from /proc")
def test_grain_workers_exit_when_the_training_process_is_killed(tmp_path):
    """With DataConfig.worker_count=2, a SIGKILL of the training process left its grain worker
    processes running, orphaned. They now exit within a second or two of their parent."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*TRAIN, f"--run_dir={run_dir}", "--gin.DataConfig.worker_count=2",
                             "--gin.RunConfig.steps=100000"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / METRICS_FILE).exists() or not read_metrics(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers             # 2 grain workers (+ a resource tracker)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 20
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only file system: a read-only bind mount of a temporary directory
    (root ignores permission bits, so a chmod would not do)."""
    source, mount = tmp_path / "source", tmp_path / "readonly"
    (source / "old_run").mkdir(parents=True)
    mount.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("needs a read-only bind mount (root with CAP_SYS_ADMIN); "
                    "test_a_refused_run_directory_is_one_line covers the logic")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_run_directory_on_a_read_only_file_system_is_one_line(read_only_dir):
    for run_dir in (read_only_dir / "new_run", read_only_dir / "old_run"):
        result = subprocess.run([*TRAIN, f"--run_dir={run_dir}"], capture_output=True, text=True,
                                timeout=300, env=ENV, cwd=REPO)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.strip() == (f"error: cannot write the run directory {run_dir} "
                                          f"(Read-only file system): choose a writable path")


def test_a_refused_run_directory_is_one_line(tmp_path, monkeypatch):
    import errno

    from dagmoe_jax import run as run_lib

    def refuse(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(type(run_lib.paths.run_path(tmp_path)), "mkdir", refuse)
    with pytest.raises(ValueError, match=rf"^cannot write the run directory {tmp_path}/run "
                                         r"\(Read-only file system\): choose a writable path$"):
        run_lib.prepare_run_dir(tmp_path / "run")


def test_a_batch_the_devices_do_not_divide_is_refused_before_anything_is_written(tmp_path):
    """The fine-tuning smoke run's batch of 4 on this process's 8 devices: one line naming the
    fix, and no run directory (it was refused at the first step, after config.json was
    written, which left a run with no checkpoint behind)."""
    from dagmoe_jax.run.gin import load_configs
    from dagmoe_jax.train.loop import train

    run_dir = tmp_path / "run"
    configs = load_configs(["finetune/smoke.gin"], [
        f"RunConfig.run_dir = '{run_dir}'", "MeshConfig.data = 8",
        f"DataConfig.source = 'instruct:{REPO / 'tests/fixtures/instruct_tiny.jsonl'}'"])
    with pytest.raises(ValueError, match=r"^DataConfig.batch_size=4 is not a multiple of the 8 "
                                         r"devices of the batch mesh axes .*: bind a multiple "
                                         r"of 8, or a MeshConfig with fewer devices on them$"):
        train(*configs, progress=False, log=lambda _m: None)
    assert not run_dir.exists()


def test_fields_newer_than_a_checkpoint_are_no_change_at_their_defaults():
    """A checkpoint written before a ModelConfig field existed (router bias, RoPE scaling, ...)
    resumes without allow_model_change when the field has its default, which keeps the old
    behaviour; any other value of it is a change."""
    import dataclasses

    from dagmoe_jax import run as run_lib
    from dagmoe_jax.config import ModelConfig
    from dagmoe_jax.run.checkpoint import json_diffs

    cfg = ModelConfig()
    new = run_lib.model_meta(cfg)
    old = json.loads(json.dumps(new))
    del old["model_config"]["rope_scaling"], old["model_config"]["block"]["router"]["bias"]
    diffs = json_diffs(old, new, "")
    assert len(diffs) == 1 + len(dataclasses.asdict(cfg.rope_scaling))
    assert run_lib.resume_changes("/nonexistent", cfg, None, old) == ([], [])
    biased = cfg.replace(block=dict(router=dict(bias=True)))
    assert run_lib.resume_changes("/nonexistent", biased, None, old) == (
        ["ModelConfig.block.router.bias (absent) -> true"], [])
    # how an earlier version ran it (the execution it kept in the model config) is no change
    old["model_config"]["execution"] = {"remat": "full", "attention": "xla"}
    assert run_lib.resume_changes("/nonexistent", cfg, None, old) == ([], [])


def _train_until(run_dir: Path, marker: str, *args: str):
    """A train.py process (stdout and stderr read line by line in threads) and a function that
    waits until ``marker`` is in its stdout (True) or the process ends (False)."""
    import threading
    import time

    proc = subprocess.Popen([*TRAIN, f"--run_dir={run_dir}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=run_dir.parent)
    seen = {"out": [], "err": []}

    def pump(stream, into):
        for line in stream:
            into.append(line)
    threads = [threading.Thread(target=pump, args=(proc.stdout, seen["out"]), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, seen["err"]), daemon=True)]
    for t in threads:
        t.start()

    def wait(timeout=240.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(marker in line for line in seen["out"]):
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.05)
        raise AssertionError(f"no {marker!r} within {timeout} s: {''.join(seen['err'])[-2000:]}")

    def finish():
        proc.wait(timeout=240)
        for t in threads:
            t.join(timeout=10)
        return proc.returncode, "".join(seen["out"]), "".join(seen["err"])
    return proc, wait, finish


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pretrain", "finetune"])
def test_ctrl_c_across_start_up_never_crashes(mode, tmp_path):
    """Ctrl-C (SIGINT to the whole process group, g++ building a kernel and grain's workers
    too) 1, 5 and 9 s into start-up, the three runs at once: each ends with exit 130 and no
    run directory, or exit 0 with a checkpoint, never a crash. A finer sweep, every 0.5 s until
    the first step: scripts/signal_sweep.py."""
    out = tmp_path / "verdicts.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "signal_sweep.py"), "--delays=1,5,9",
         "--parallel=3", f"--json={out}", *(["--finetune"] if mode == "finetune" else [])],
        capture_output=True, text=True, env=single_device_env(), timeout=600)
    verdicts = json.loads(out.read_text())
    assert result.returncode == 0 and all(v["clean"] for v in verdicts), result.stdout
    assert len(verdicts) == 3 and any(v["code"] == 130 for v in verdicts)


@pytest.mark.slow
def test_a_signal_at_any_moment_is_one_clean_stop(tmp_path):
    """SIGINT while the libraries load and the run starts: exit 130, one line, no run
    directory. SIGINT while step 1 compiles: the step finishes, is saved, exit 0. (SIGTERM mid
    run, saved and resumed bit for bit: test_train.py's
    test_sigterm_saves_and_exits_cleanly_then_resumes.)"""
    import signal
    import time

    # start-up: while the libraries load, and once the configuration is read
    for marker in (None, "config:"):
        run_dir = tmp_path / f"startup_{marker is None}"
        proc, wait, finish = _train_until(run_dir, marker or "\0")
        if marker is None:
            time.sleep(1.0)
        else:
            assert wait()
        proc.send_signal(signal.SIGINT)
        code, out, err = finish()
        lines = err.strip().splitlines()
        assert code == 130 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith("error: SIGINT received before training began")
        assert not run_dir.exists()
    # while the first step compiles: it completes, is checkpointed and the run stops cleanly
    compiled = tmp_path / "compile"
    proc, wait, finish = _train_until(compiled, "step 1: compiling the training step")
    assert wait()
    proc.send_signal(signal.SIGINT)
    code, out, err = finish()
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert "SIGINT received: saved a checkpoint at step 1" in out
