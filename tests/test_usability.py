"""What a new user runs into: cloud run directories, short runs, progress lines, evaluation
bindings, gin quoting, W&B logging, sampling with SentencePiece and readable plots (issue 16).

One 6-step smoke run (subprocess, as a user runs it) feeds the training-loop checks; a second
start of the finished run and an evaluation with data bindings run side by side after it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import build_once, single_device_env
from dagmoe_jax import run as run_lib
from dagmoe_jax.analysis import plots
from dagmoe_jax.analysis.report import curve_series
from dagmoe_jax.run.gin import load_configs
from dagmoe_jax.run import checkpoint_files as ckpt
from dagmoe_jax.run.records import METRICS_FILE, read_metrics
from dagmoe_jax.train.metrics import MetricsWriter

REPO = Path(__file__).resolve().parent.parent
ENV = single_device_env(DAGMOE_TCMALLOC="0")
SHORT = [sys.executable, str(REPO / "train.py"), "--gin_file=train/smoke.gin", "--no_progress",
         "--gin.RunConfig.steps=6", "--gin.RunConfig.log_every=2",
         "--gin.RunConfig.eval_every=0", "--gin.RunConfig.task_eval_examples=0",
         "--gin.RunConfig.tensorboard=False", "--gin.OptimConfig.warmup_steps=2000"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """(run_dir, first run, second start of the finished run, eval with bindings): their
    outputs, built once for the whole run (conftest.build_once)."""
    run_dir, first, again, evaluated, refused = build_once(tmp_path_factory, "usability",
                                                           _short_run)
    return Path(run_dir), first, again, evaluated, refused


def _short_run(root: Path) -> list:
    run_dir = root / "run"
    first = subprocess.run([*SHORT, f"--run_dir={run_dir}"], capture_output=True, text=True,
                           env=ENV, timeout=300)
    assert first.returncode == 0, first.stderr
    # The third resumes with another top_k as a user would, JAX_PLATFORMS unset: JAX left to
    # start the TPU and CUDA plugins the suite installs, on a host with neither.
    no_platform = {k: v for k, v in ENV.items() if k != "JAX_PLATFORMS"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
             for cmd, env in (([*SHORT, f"--run_dir={run_dir}"], ENV),
                              ([sys.executable, str(REPO / "train.py"), "--mode=eval",
                                f"--run_dir={run_dir}", "--gin.DataConfig.num_synthetic_eval=8",
                                "--gin.DataConfig.batch_size=4"], ENV),
                              ([*SHORT, f"--run_dir={run_dir}", "--gin.RouterConfig.top_k=1"],
                               no_platform))]
    done = []
    for proc, code in zip(procs, (0, 0, 2)):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == code, err
        done.append(out if code == 0 else err)
    return [str(run_dir), first.stdout, *done]


@pytest.mark.slow
def test_a_refused_resume_is_one_line_with_the_accelerator_plugins_installed(short_run):
    """With libtpu and the CUDA plugin installed (requirements-tpu.txt) and neither device
    here, a command prints its refusal alone: not libtpu's start-up lines, not the plugin's
    traceback."""
    refused = short_run[4]
    assert refused.splitlines() == [refused.strip()], refused
    assert refused.startswith("error: the model config differs from the checkpoint's")
    assert "ModelConfig.block.router.top_k 2 -> 1" in refused


@pytest.mark.slow
def test_a_short_run_fits_its_warmup_and_says_so(short_run):
    _, out, _, _, _ = short_run
    assert ("note: OptimConfig.warmup_steps=2000 does not fit in this 6-step run: no warm-up "
            "instead") in out
    records = [r for r in read_metrics(short_run[0]) if "learning_rate" in r]
    assert records and all(r["learning_rate"] == pytest.approx(3e-3) for r in records)


@pytest.mark.slow
def test_progress_lines_and_compile_time_left_out(short_run):
    run_dir, out, _, _, _ = short_run
    lines = out.splitlines()
    compiling = lines.index("step 1: compiling the training step...")
    compiled = next(i for i, line in enumerate(lines) if line.startswith("step 1: compiled"))
    seconds = float(re.search(r"in ([\d.]+) s", lines[compiled]).group(1))
    assert compiling < compiled
    plain = [line for line in lines if re.match(r"step \d+/6: loss ", line)]
    assert [line.split("/")[0] for line in plain] == ["step 2", "step 4", "step 6"]
    assert "ETA" in plain[0] and "tok_s" in plain[0]
    record = next(r for r in read_metrics(run_dir) if r["step"] == 2)
    # The window of step 2 is step 2 alone: had it included step 1's compilation, tokens/s
    # would be at most 2 steps' tokens over the compile time.
    with_compile = 2 * 8 * 64 / seconds
    assert record["tokens_per_sec"] > 3 * with_compile, (record["tokens_per_sec"], seconds)


@pytest.mark.slow
def test_a_finished_run_started_again_does_not_log_its_eval_twice(short_run):
    run_dir, _, again, _, _ = short_run
    assert "nothing left to train" in again and "final eval at step 6" in again
    evals = [r for r in read_metrics(run_dir) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [6]


@pytest.mark.slow
def test_eval_mode_honours_data_bindings(short_run):
    run_dir, first, _, evaluated, _ = short_run
    own = float(re.search(r"final eval at step 6: held-out loss ([\d.]+)", first).group(1))
    other = float(re.search(r"held-out loss ([\d.]+)", evaluated).group(1))
    assert other != own            # 8 held-out examples in batches of 4, not the run's own 64


def _cli(argv, capsys):
    from dagmoe_jax.cli.train import main
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err


def test_eval_mode_rejects_other_bindings_and_unquoted_strings(tmp_path, capsys):
    for argv, expected in (
            ([f"--run_dir={tmp_path}", "--mode=eval", "--gin.DataConfig.source='text:x'"],
             "apply at evaluation, not DataConfig.source"),
            ([f"--run_dir={tmp_path}", "--mode=eval", "--gin.ModelConfig.d_model=8"],
             "apply at evaluation, not ModelConfig.d_model"),
            ([f"--run_dir={tmp_path}", "--mode=eval", "--gin.DataConfig.text_key=body"],
             """write --gin.DataConfig.text_key="'body'\""""),
            ([f"--run_dir={tmp_path}", "--mode=eval", "--gin_file=train/smoke.gin"],
             "drop --gin_file"),
            (["--gin_file=train/smoke.gin", "--gin.DataConfig.tokenizer=hf"],
             """write --gin.DataConfig.tokenizer="'hf'\"""")):
        code, err = _cli(argv, capsys)
        assert code == 2 and err.startswith("error: ") and expected in err, err
        assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- cloud run dirs

@pytest.fixture
def fresh_epath_filesystems():
    """epath caches one fsspec filesystem per scheme: start and end each test without one."""
    from etils.epath import backend
    backend.fsspec_backend._get_filesystem.cache_clear()
    yield
    backend.fsspec_backend._get_filesystem.cache_clear()


def test_gs_run_dir_without_gcsfs_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch,
                                                                  fresh_epath_filesystems):
    monkeypatch.setitem(sys.modules, "gcsfs", None)          # not installed
    monkeypatch.chdir(tmp_path)
    code, err = _cli(["--gin_file=train/smoke.gin", "--run_dir=gs://bucket/run"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "needs the gcsfs package" in err and "pip install gcsfs" in err
    assert list(tmp_path.iterdir()) == []                    # no local 'gs:' directory


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch, fresh_epath_filesystems):
    """gs:// served by a local directory (an fsspec filesystem registered for 'gs'); returns
    that directory. The working directory is another, empty one."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    bucket_root = tmp_path / "gcs"
    bucket_root.mkdir()

    class FakeGCS(LocalFileSystem):
        protocol = ("gs", "gcs")

        @classmethod
        def _strip_protocol(cls, path):
            path = os.fspath(path)
            if path.startswith(f"{bucket_root}/"):           # already a local path
                return path
            for prefix in ("gs://", "gcs://"):
                if path.startswith(prefix):
                    path = path[len(prefix):]
            return str(bucket_root / path.lstrip("/")).rstrip("/")

    fsspec.register_implementation("gs", FakeGCS, clobber=True)
    fsspec.register_implementation("gcs", FakeGCS, clobber=True)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield bucket_root
    for name in ("gs", "gcs"):
        sys.modules["fsspec.registry"]._registry.pop(name, None)  # pylint: disable=protected-access
    assert list(cwd.iterdir()) == []


def test_run_dir_io_goes_through_epath_to_cloud_storage(fake_gcs):
    uri = "gs://bucket/runs/a"
    path = run_lib.prepare_run_dir(uri)
    assert str(path) == uri and (fake_gcs / "bucket/runs/a").is_dir()
    model, data, optim, train = load_configs(["train/smoke.gin"], [f"RunConfig.run_dir = '{uri}'"])
    run_lib.save_configs(uri, model, data, optim, train)
    assert json.loads((fake_gcs / "bucket/runs/a/config.json").read_text())["run"]["run_dir"] == uri
    assert run_lib.load_configs(uri) == (model, data, optim, train)
    writer = MetricsWriter(uri, tensorboard=False)
    for step in (1, 2, 3):
        writer.write(step, {"loss": 1.0 / step, "dropped_fraction": np.array([0.5, 0.25])})
    writer.close()
    resumed = MetricsWriter(uri, tensorboard=False, resume_step=2)   # steps after 2 re-done
    resumed.write(3, {"loss": 0.3})
    resumed.close()
    local = (fake_gcs / "bucket/runs/a" / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in local] == [1, 2, 3]
    assert read_metrics(uri)[-1] == {"step": 3, "loss": 0.3}
    assert read_metrics(uri)[0]["dropped_fraction"] == [0.5, 0.25]
    # A checkpoint step's manifest: written, verified, and a changed file named.
    step = fake_gcs / "bucket/runs/a/checkpoints/5"
    (step / "state").mkdir(parents=True)
    (step / "state/array").write_bytes(b"\x00" * 100)
    (step / "meta").write_text("{}")
    ckpt.write_checksums(f"{uri}/checkpoints/5")
    assert set(json.loads((step / ckpt.CHECKSUM_FILE).read_text())) == {"state/array", "meta"}
    ckpt.verify_checksums(f"{uri}/checkpoints/5")
    (step / "state/array").write_bytes(b"\x01" * 100)
    with pytest.raises(ValueError, match="state/array is changed"):
        ckpt.verify_checksums(f"{uri}/checkpoints/5")


def test_tensorboard_in_a_bucket_without_its_client_stops_before_writing(fake_gcs, monkeypatch):
    from dagmoe_jax.train.loop import train
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)
    configs = load_configs(["train/smoke.gin"], ["RunConfig.run_dir = 'gs://bucket/run'"])
    with pytest.raises(ValueError, match=r"^TensorBoard logging to gs://bucket/run needs the "
                                         r"google-cloud-storage package: pip install "):
        train(*configs, progress=False, log=lambda _: None)
    assert list(fake_gcs.iterdir()) == []


def test_file_uri_and_unknown_schemes(tmp_path):
    from dagmoe_jax.run.paths import as_path
    path = run_lib.prepare_run_dir(f"file://{tmp_path}/r")
    assert (tmp_path / "r").is_dir() and str(path) == f"{tmp_path}/r"
    with pytest.raises(ValueError, match="the ftp:// scheme is not supported"):
        as_path("ftp://host/run")


# ----------------------------------------------------------------------------------- W&B

class _FakeWandb(types.ModuleType):
    """What WandbWriter uses of wandb: init() -> run with log() and finish(); Histogram."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0
        fake = self

        class Run:
            def log(self, data, step):
                fake.logged.append((step, data))

            def finish(self):
                fake.finished += 1

        class Histogram:
            def __init__(self, values):
                self.values = np.asarray(values)

        self._run_cls, self.Histogram = Run, Histogram

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self._run_cls()


def test_wandb_writer_logs_scalars_per_layer_values_and_histograms(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    load = np.array([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]])
    writer = MetricsWriter(tmp_path, tensorboard=False, wandb_project="dagmoe",
                           wandb_mode="offline", config={"train": {"steps": 6}})
    writer.write(2, {"loss": 2.5, "expert_load": load, "dropped_fraction": np.array([0.1, 0.0])})
    writer.write(2, {"loss": 2.25}, prefix="eval/")
    writer.close()
    init = fake.inits[0]
    assert (init["project"], init["mode"], init["dir"], init["resume"]) == (
        "dagmoe", "offline", str(tmp_path), "allow")
    assert init["config"] == {"train": {"steps": 6}} and init["name"] == tmp_path.name
    (step, data), (eval_step, eval_data) = fake.logged
    assert step == 2 and eval_step == 2 and eval_data == {"eval/loss": 2.25}
    assert data["loss"] == 2.5
    for layer in range(2):
        assert data[f"load_imbalance/layer_{layer}"] == pytest.approx(
            load[layer].max() / load[layer].mean())
        np.testing.assert_array_equal(data[f"expert_load/layer_{layer}"].values, load[layer])
    assert data["dropped_fraction/layer_0"] == pytest.approx(0.1)
    assert fake.finished == 1
    assert [r["step"] for r in read_metrics(tmp_path)] == [2, 2]    # the JSONL log too
    MetricsWriter(tmp_path, tensorboard=False, wandb_project="dagmoe", resume_step=2).close()
    assert fake.inits[1]["id"] == init["id"]                       # a resume continues the run


def test_wandb_missing_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    from dagmoe_jax.train.loop import train
    monkeypatch.setitem(sys.modules, "wandb", None)
    run_dir = tmp_path / "run"
    configs = load_configs(["train/smoke.gin"], [f"RunConfig.run_dir = '{run_dir}'",
                                                 "RunConfig.wandb_project = 'p'"])
    with pytest.raises(ValueError, match=r"wandb is not installed: pip install 'dagmoe-jax\[wandb\]'"):
        train(*configs, progress=False, log=lambda _: None)
    assert not run_dir.exists()


# ---------------------------------------------------------------------- sampling, plots

def test_sentencepiece_sample_keeps_the_space_between_prompt_and_continuation(tmp_path):
    import sentencepiece as spm
    from dagmoe_jax.data.tokenizers import SentencePieceTokenizer
    from dagmoe_jax.cli.sample import sample_text

    (tmp_path / "corpus.txt").write_text("\n".join(f"the quick brown fox {i} jumps over the "
                                                   f"lazy dog" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"),
                                   model_prefix=str(tmp_path / "sp"), vocab_size=120,
                                   model_type="bpe", minloglevel=2)
    tok = SentencePieceTokenizer(str(tmp_path / "sp.model"))
    prompt, continuation = tok.encode("the quick brown"), tok.encode(" fox jumps")
    assert tok.decode(prompt) + tok.decode(continuation) == "the quick brownfox jumps"
    assert sample_text(tok, prompt, continuation) == "the quick brown fox jumps"


def test_edge_gates_share_one_scale_per_kind_with_values_for_small_k():
    rng = np.random.default_rng(0)
    mean = 0.5 + 0.01 * rng.random((2, 2, 2, 2))             # gates within 2% of each other
    std = 0.02 * rng.random((2, 2, 2, 2))
    fig = plots.edge_gates_figure(mean, std)
    panels = [ax for ax in fig.axes if ax.images]
    means = [ax.images[0] for ax in panels if "mean" in ax.get_title()]
    stds = [ax.images[0] for ax in panels if "std" in ax.get_title()]
    assert len(means) == len(stds) == 4
    assert {image.get_clim() for image in means} == {(0.0, mean.max())}
    assert {image.get_clim() for image in stds} == {(0.0, std.max())}
    first = next(ax for ax in panels if ax.get_title() == "layer 0, iteration 1: mean over tokens")
    assert sorted(t.get_text() for t in first.texts) == sorted(f"{v:.3g}" for v in
                                                                mean[0, 0].ravel())
    assert fig._suptitle.get_text() == plots.EDGE_GATES_TITLE and "How much" in plots.EDGE_GATES_TITLE
    big = plots.edge_gates_figure(rng.random((1, 1, 6, 6)), rng.random((1, 1, 6, 6)))
    assert not any(ax.texts for ax in big.axes)            # K = 6: the colours alone
    plots.plt.close("all")


def test_training_curves_from_metric_records(tmp_path):
    records = [{"step": 4, "loss": 2.0, "learning_rate": 1e-3}, {"step": 2, "loss": 3.0,
                                                                "learning_rate": 5e-4},
               {"step": 4, "eval/loss": 2.5}, {"step": 2, "eval/loss": 3.5, "loss": "nan"}]
    steps, loss, lr, eval_steps, eval_loss = curve_series(records)
    assert steps == [2, 4] and loss.tolist() == [3.0, 2.0] and lr.tolist() == [5e-4, 1e-3]
    assert eval_steps == [2, 4] and eval_loss.tolist() == [3.5, 2.5]
    assert curve_series([{"step": 1, "eval/loss": 1.0}]) is None
    path = plots.plot_training_curves(steps, loss, lr, eval_steps, eval_loss,
                                      tmp_path / "curves.png")
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 2000
