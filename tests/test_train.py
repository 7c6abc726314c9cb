"""train.py end to end: training, evaluation, resume after SIGKILL / SIGTERM, corrupt
checkpoints, gin overrides and the guards. Each run is a real subprocess of ``train.py`` on the
smoke config (configs/train/smoke.gin: the tiny DAG-MoE, 40 steps of 8 x 64 tokens)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from dagmoe_jax.run.gin import load_configs
from dagmoe_jax.run.records import read_metrics
from conftest import build_once, make_model, single_device_env

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(REPO / "train.py"), "--gin_file=train/smoke.gin", "--no_progress"]
ENV = single_device_env()


def run(run_dir: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN, f"--run_dir={run_dir}", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV, cwd=run_dir.parent)


def start(run_dir: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*TRAIN, f"--run_dir={run_dir}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=run_dir.parent)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_metrics(run_dir)
        if records and max(r["step"] for r in records) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited early: {proc.communicate()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"train.py did not reach step {step} in {timeout}s")


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def checkpoint_steps(run_dir: Path) -> list:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple:
    """One uninterrupted 40-step smoke run (shared: the other tests compare with it; built
    once for the whole run, conftest.build_once): (run_dir, its output)."""
    def build(root: Path) -> list:
        result = run(root / "run")
        assert result.returncode == 0, result.stderr
        return [str(root / "run"), result.stdout]
    run_dir, stdout = build_once(tmp_path_factory, "reference", build)
    return Path(run_dir), types.SimpleNamespace(stdout=stdout)


@pytest.mark.slow
def test_train_end_to_end(reference):
    run_dir, result = reference
    assert "final eval at step 40: held-out loss" in result.stdout
    assert "unigram baseline" in result.stdout and "exact answers" in result.stdout
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 41))
    first, last = sum(curve[s] for s in range(1, 6)) / 5, sum(curve[s] for s in range(36, 41)) / 5
    assert last < first - 0.5, (first, last)
    assert checkpoint_steps(run_dir) == [20, 30, 40]            # keep 3, every 10, the last
    records = read_metrics(run_dir)
    logged = next(r for r in records if r["step"] == 40 and "loss" in r)
    for key in ("ce_loss", "balance_loss", "z_loss", "grad_norm", "learning_rate",
                "tokens_per_sec", "expert_load", "dropped_fraction"):
        assert key in logged, key
    assert len(logged["expert_load"]) == 2 and len(logged["expert_load"][0]) == 8
    assert any("eval/loss" in r and r["step"] == 20 for r in records)   # periodic eval
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["block"]["aggregation"]["kind"] == "dag"
    operative = (run_dir / "operative_config.gin").read_text()
    assert "ModelConfig.d_model = %D_MODEL" in operative and "RunConfig.steps = 40" in operative


@pytest.mark.slow
def test_eval_mode_scores_the_checkpoint(reference, tmp_path):
    run_dir, _ = reference
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--mode=eval",
                             f"--run_dir={run_dir}"], capture_output=True, text=True, env=ENV,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"eval of {run_dir} at step 40" in result.stdout and "perplexity" in result.stdout
    text = tmp_path / "notes.txt"
    text.write_text("lis 1 2 3 = 3\n\nedit ab ab = 0\n" * 20)
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--mode=eval",
                             f"--run_dir={run_dir}", f"--eval_source=text:{text}"],
                            capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"on text:{text}" in result.stdout


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_run_bit_for_bit(reference, tmp_path):
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for_step(proc, run_dir, 25)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert max(losses(run_dir)) < 40
    result = run(run_dir)
    assert result.returncode == 0, result.stderr
    assert "resumed from step" in result.stdout
    assert losses(run_dir) == losses(ref_dir)                    # exact float equality
    final = [line for line in result.stdout.splitlines() if line.startswith("final eval")]
    ref_final = [line for line in reference[1].stdout.splitlines() if line.startswith("final eval")]
    assert final == ref_final


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly_then_resumes(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for_step(proc, run_dir, 12)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    line = next(line for line in out.splitlines() if "SIGTERM received" in line)
    stopped = int(line.split("at step ")[1].split()[0])
    assert stopped < 40 and stopped in checkpoint_steps(run_dir)
    result = run(run_dir)
    assert result.returncode == 0 and f"resumed from step {stopped}" in result.stdout
    assert losses(run_dir) == losses(reference[0])


@pytest.mark.slow
def test_truncated_latest_checkpoint_falls_back_to_the_previous(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    files = [p for p in (run_dir / "checkpoints" / "40").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    result = run(run_dir)
    assert result.returncode == 0, result.stderr
    assert "checkpoint step 40" in result.stdout and "falling back to step 30" in result.stdout
    assert "resumed from step 30" in result.stdout
    assert losses(run_dir) == losses(reference[0])
    assert 40 in checkpoint_steps(run_dir)                        # re-written, good this time


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    result = run(run_dir, "--gin.RunConfig.steps=60", "--gin.OptimConfig.learning_rate=1e9",
                 "--gin.OptimConfig.grad_clip=0.0", "--gin.OptimConfig.schedule='constant'",
                 "--gin.OptimConfig.warmup_steps=0")
    assert result.returncode == 1, (result.stdout, result.stderr)
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and "loss is" in message[0] and "last good one" in message[0]
    assert checkpoint_steps(run_dir)[-1] == 40


def _one_line_error(capsys, run_dir: Path, args, *fragments):
    """train.py's ``main`` in this process (what the console script calls): exit status 2 and
    one line on stderr holding each fragment."""
    from dagmoe_jax.cli.train import main

    code = main([*TRAIN[2:], f"--run_dir={run_dir}", *args])
    captured = capsys.readouterr()
    assert code == 2, (captured.out, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args, fragments", [
    (["--gin.RunConfig.stepz=3"], ["stepz"]),
    (["--gin_file=no_such_config.gin"], ["no_such_config.gin", "not found"]),
    (["--gin.RunConfig.steps=0"], ["RunConfig.steps=0"]),
    (["--gin.DataConfig.seq_len=256"], ["seq_len=256", "max_seq_len=128"]),
    (["--gin.ModelConfig.vocab_size=100"], ["vocab_size=100", "256"]),
    (["--gin.DataConfig.source='text:/no/such/dir/*.txt'"], ["matched no file"]),
    (["--bogus"], ["--bogus"]),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, args, fragments):
    _one_line_error(capsys, tmp_path / "run", args, *fragments)


def test_empty_dataset_is_a_one_line_error(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    _one_line_error(capsys, tmp_path / "run", [f"--gin.DataConfig.source='text:{empty}'"],
                    "empty")


@pytest.mark.slow
def test_bad_input_through_the_command_line_is_a_one_line_error(tmp_path):
    """The same check through ``python train.py`` itself (its entry point and exit status)."""
    result = run(tmp_path / "run", "--gin.RunConfig.stepz=3", timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "stepz" in lines[0], \
        result.stderr


def test_gin_overrides_reach_the_model():
    model_cfg, data_cfg, optim_cfg, run_cfg = load_configs(
        ["train/smoke.gin"], ["AggregationConfig.dag_iters = 3", "DataConfig.seq_len = 32",
                              "OptimConfig.learning_rate = 0.5", "RunConfig.steps = 7"])
    assert (model_cfg.block.aggregation.dag_iters, data_cfg.seq_len, optim_cfg.learning_rate,
            run_cfg.steps) == (3, 32, 0.5, 7)
    model = make_model(model_cfg)
    w_down = model.layers.block.aggregator.iterations.w_down
    assert w_down.shape[:2] == (2, 3)                              # [layers, L, d, d_g]


@pytest.mark.parametrize("epochs, says", [
    (0, "RunConfig.steps=4: nothing left to train (raise steps to continue)"),
    (2, "RunConfig.epochs=2 ends at step 4: nothing left to train (raise epochs to continue)")])
def test_a_finished_run_says_which_setting_to_raise(tiny, epochs, says):
    """A checkpoint at the run's last step: a run sized by RunConfig.epochs says to raise
    epochs (its steps are derived), one sized by steps to raise steps."""
    import optax
    from flax import nnx
    from dagmoe_jax.run.checkpoint import Restored
    from dagmoe_jax.train.trainer import Trainer

    model = make_model(tiny("dense"))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    finished = types.SimpleNamespace(restore=lambda *_a, **_k: Restored(
        step=4, state={"model": nnx.state(model)}, meta={}))
    messages = []
    trainer = Trainer(model, optimizer, None, iter(()), finished, total_steps=4,
                      say=messages.append, epochs=epochs)
    assert trainer.restore_or_init() == 4
    assert messages[-1] == f"warning: the checkpoint is at step 4 and {says}", messages


def test_gradient_accumulation_matches_the_full_batch(tiny):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from dagmoe_jax.train.step import make_train_step
    # The router losses are not linear in the batch (the load is a batch statistic), so they are
    # off here: with them on, accumulation legitimately differs from one big batch. Summed
    # experts: the accumulation is the step's, whatever the block computes (and compiles faster).
    cfg = tiny("moe", "sum", router=dict(balance_coef=0.0, z_loss_coef=0.0))
    rng = np.random.default_rng(0)
    # Uneven masks (answer-only fine-tuning): the micro-batches hold 2, 9, 30 and 64 trained
    # tokens, so averaging their means would weight a token of the first 32x one of the last.
    mask = np.zeros((8, 16), bool)
    for row, n in enumerate((1, 1, 4, 5, 14, 16, 16, 16)):
        mask[row, :n] = True
    batch = {"inputs": jnp.asarray(rng.integers(0, 64, (8, 16)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, 64, (8, 16)), jnp.int32),
             "mask": jnp.asarray(mask)}
    params, metrics = [], []
    for accum in (1, 4):
        model = make_model(cfg, grouped_matmul="einsum")
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
        metrics.append(make_train_step(grad_accum=accum)(model, optimizer, batch))
        params.append(nnx.state(model, nnx.Param))
    np.testing.assert_allclose(metrics[1]["ce_loss"], metrics[0]["ce_loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics[1]["grad_norm"], metrics[0]["grad_norm"], rtol=1e-4)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                         params[0], params[1]))
    assert max(moved) < 1e-5
    # The same micro-batches averaged by their means (the step before) give another gradient.
    from dagmoe_jax.train import step as step_lib
    model = make_model(cfg, grouped_matmul="einsum")
    grad = nnx.jit(lambda model, part: nnx.grad(  # noqa: E731
        lambda m: step_lib.lm_loss(m, part)[0])(model))
    full = grad(model, batch)
    means = [grad(model, {k: v[2 * i:2 * i + 2] for k, v in batch.items()}) for i in range(4)]
    averaged = jax.tree.map(lambda *g: sum(g) / 4, *means)
    gaps = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                        nnx.state(full, nnx.Param),
                                        nnx.state(averaged, nnx.Param)))
    assert max(gaps) > 100 * 1e-5 / 0.5
    with pytest.raises(ValueError, match="grad_accum=3"):
        make_train_step(grad_accum=3)(model, optimizer, batch)


def test_a_relative_tokenizer_path_is_recorded_absolute(tmp_path, monkeypatch):
    """A run trained with a tokenizer path relative to where it ran records it absolute, so
    the run is read from any working directory (issue 34: paths a run records are absolute)."""
    from conftest import write_special_tokenizer
    from dagmoe_jax.run import load_run
    from dagmoe_jax.train.loop import train

    write_special_tokenizer(tmp_path / "tok", "no_bos")
    (tmp_path / "corpus.txt").write_text("hello there, a tiny corpus of text.\n\n" * 100)
    monkeypatch.chdir(tmp_path)
    configs = load_configs(["train/smoke.gin"], [
        "DataConfig.tokenizer = 'hf'", "DataConfig.tokenizer_path = 'tok/tokenizer.json'",
        "DataConfig.source = 'text:corpus.txt'", "DataConfig.batch_size = 8",
        "ModelConfig.vocab_size = 259", "ModelConfig.d_model = 64", "ModelConfig.num_layers = 2",
        "RunConfig.steps = 1", "RunConfig.run_dir = 'run'", "RunConfig.tensorboard = False"])
    train(*configs, progress=False, log=lambda _m: None)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert recorded["tokenizer_path"] == str(tmp_path / "tok" / "tokenizer.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_run(tmp_path / "run").tokenizer.encode("hi") == [104, 105]
