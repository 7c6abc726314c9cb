"""The training loop: data -> jitted step -> metrics, evaluation and checkpoints, resumable.

``train(...)`` runs (or resumes) a run in ``TrainConfig.run_dir`` and reports progress on a
tqdm bar; ``evaluate_checkpoint(...)`` scores a run's newest checkpoint on a dataset. Both are
what ``train.py`` calls, and both work from a notebook.

Nothing is lost on interruption: SIGTERM or Ctrl-C finishes the current step, saves a
checkpoint (with the data iterator's position) and returns; a run started again in the same
directory continues exactly where it stopped, to the bit on CPU. A non-finite loss stops the run
without saving, so the newest checkpoint on disk is the last good one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.data import (DataConfig, check_tokens, eval_batches, exact_match, make_tokenizer,
                             task_eval_batches, task_names, train_dataset, unigram_entropy)
from dagmoe_jax import runs
from dagmoe_jax.paths import run_path
from dagmoe_jax.model import Transformer
from dagmoe_jax.parallel import MeshConfig, activate, create_train_state, make_mesh, shard_batch
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.settle import describe as describe_settled
from dagmoe_jax.settle import settle
from dagmoe_jax.topics.stage import run_topics
from dagmoe_jax.train.checkpoint import Checkpointer
from dagmoe_jax.train.config import TrainConfig
from dagmoe_jax.train.metrics import (MetricsWriter, check_tensorboard_target, read_metrics,
                                      require_wandb, summarise_load)
from dagmoe_jax.train.optim import OptimConfig, make_optimizer, make_schedule, schedule_note
from dagmoe_jax.train.step import TRAINABLE, check_trainable, eval_step, make_train_step



class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the newest checkpoint on disk is the last good one."""


@dataclasses.dataclass
class RunResult:
    """What ``train`` did: the last step reached, the final evaluation, and why it stopped."""

    run_dir: str
    step: int
    resumed_from: Optional[int]
    interrupted: bool
    eval: Dict[str, float]
    losses: Dict[int, float]


def check_compatible(model_cfg: ModelConfig, data_cfg: DataConfig, tokenizer) -> None:
    """One-line errors for a data setup the model cannot take."""
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"DataConfig.seq_len={data_cfg.seq_len} exceeds ModelConfig.max_seq_len="
                         f"{model_cfg.max_seq_len}: shorten the sequences or raise max_seq_len")
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the {data_cfg.tokenizer!r} tokenizer has {tokenizer.vocab_size} tokens "
                         f"but ModelConfig.vocab_size={model_cfg.vocab_size}: set vocab_size >= "
                         f"{tokenizer.vocab_size}")


def build(model_cfg: ModelConfig, optim_cfg: OptimConfig, train_cfg: TrainConfig, mesh=None,
          log: Callable[[str], None] = lambda _message: None):
    """(model, optimizer, schedule) for a run: parameters initialised from ``train_cfg.seed``,
    created directly sharded over ``mesh`` when one is given (optimizer state too).

    The model is built from ``model_cfg`` settled for this machine and mesh
    (:func:`dagmoe_jax.settle.settle`; ``model.cfg`` is the settled config)."""
    tx = make_optimizer(optim_cfg, train_cfg.steps)
    check_trainable(model_cfg, train_cfg.trainable)
    wrt = TRAINABLE[train_cfg.trainable]
    layout = MeshLayout.of(mesh)
    settled = settle(model_cfg, layout=layout, log=log)

    def new_model():
        return Transformer(settled, rngs=nnx.Rngs(train_cfg.seed), layout=layout)
    if mesh is None:
        model = new_model()
        optimizer = nnx.Optimizer(model, tx, wrt=wrt)
    else:
        model, optimizer = create_train_state(new_model, tx, mesh, wrt=wrt)
    return model, optimizer, make_schedule(optim_cfg, train_cfg.steps)


def _train_state(model, optimizer):
    return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


_MODEL_INPUTS = ("inputs", "targets", "mask", "topics", "topic_labels")


def _device_batch(batch: Dict[str, np.ndarray], mesh=None) -> Dict[str, jax.Array]:
    """The model's inputs of a host batch on the device(s): this process's rows of the global
    batch sharded over ``mesh``'s batch axes, or (no mesh) on the default device."""
    batch = {k: v for k, v in batch.items() if k in _MODEL_INPUTS}
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    return shard_batch(batch, mesh)


def _replicated_batch(batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
    """An evaluation batch (the same whole batch on every process) replicated on every device
    of the active mesh, so its outputs are readable on every host and any row count works."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or jax.process_count() == 1:
        return {k: jnp.asarray(v) for k, v in batch.items() if k in _MODEL_INPUTS}
    sharding = jax.sharding.NamedSharding(jax.sharding.get_mesh(), jax.sharding.PartitionSpec())
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), np.shape(v))
            for k, v in batch.items() if k in _MODEL_INPUTS}


def evaluate(model: Transformer, batches: Iterable[Dict[str, np.ndarray]]) -> Dict[str, float]:
    """Token-weighted held-out cross-entropy (nats/token) and perplexity over ``batches``."""
    ce_sum, tokens = 0.0, 0.0
    for batch in batches:
        out = eval_step(model, _replicated_batch(batch))
        ce_sum += float(out["ce_sum"])
        tokens += float(out["tokens"])
    if tokens == 0:
        raise ValueError("the evaluation data has no tokens: check DataConfig.eval_source / "
                         "heldout_fraction")
    loss = ce_sum / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


def task_accuracy(model: Transformer, batches: Iterable[Dict[str, np.ndarray]],
                  names: List[str]) -> Dict[str, float]:
    """Exact-answer accuracy (greedy answer == reference) overall and per synthetic task."""
    right, total = np.zeros(len(names)), np.zeros(len(names))
    for batch in batches:
        predictions = np.asarray(eval_step(model, _replicated_batch(batch))["predictions"])
        correct = exact_match(predictions, batch["targets"], batch["mask"])
        np.add.at(right, batch["task_id"], correct)
        np.add.at(total, batch["task_id"], 1)
    result = {"exact_match": float(right.sum() / max(total.sum(), 1))}
    for name, r, t in zip(names, right, total):
        if t:
            result[f"exact_match/{name}"] = float(r / t)
    return result


@contextlib.contextmanager
def _stop_on_signals(flag: dict):
    """SIGTERM / SIGINT set ``flag['signal']`` (the first one's name) instead of killing the
    process (main thread); further signals change nothing until the block is left."""
    def handler(signum, frame):
        flag.setdefault("signal", signal.Signals(signum).name)
    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread (e.g. some notebook runners): no handlers
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class _Evaluator:
    """Held-out perplexity (+ exact-answer accuracy on synthetic tasks), data built once."""

    def __init__(self, data_cfg: DataConfig, train_cfg: TrainConfig, tokenizer, topics=None):
        # Every process evaluates the whole (small) held-out set, replicated on its devices.
        self.batches = eval_batches(data_cfg, tokenizer, max_batches=train_cfg.eval_batches or None,
                                    topics=topics)
        self.task_batches, self.task_names = [], []
        kind = data_cfg.source.split(":", 1)[0]
        if train_cfg.task_eval_examples and kind == "synthetic" and not data_cfg.eval_source:
            self.task_names = list(task_names(data_cfg))
            self.task_batches = task_eval_batches(data_cfg, tokenizer,
                                                  num_examples=train_cfg.task_eval_examples,
                                                  batch_size=data_cfg.batch_size)

    def __call__(self, model) -> Dict[str, float]:
        result = evaluate(model, self.batches)
        if self.task_batches:
            result.update(task_accuracy(model, self.task_batches, self.task_names))
        return result


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                dynamic_ncols=True, mininterval=1.0, smoothing=0.1)


def train(model_cfg: ModelConfig, data_cfg: DataConfig, optim_cfg: OptimConfig,
          train_cfg: TrainConfig, *, progress: bool = True,
          log: Callable[[str], None] = print, operative_gin: str = "") -> RunResult:
    """Train (or resume) the run in ``train_cfg.run_dir``; returns a :class:`RunResult`.

    ``log`` receives one-line reports (resume, evaluations, stop reasons); the progress bar
    shows step, loss, tokens/s and ETA. Raises :class:`NonFiniteLossError` on a NaN/inf loss.
    """
    process = (jax.process_index(), jax.process_count())
    is_main = process[0] == 0
    say = log if is_main else (lambda _msg: None)
    run_path(train_cfg.run_dir)                  # its filesystem is reachable (else one line)
    if is_main:                                  # sinks that cannot work: before anything is written
        if train_cfg.wandb_project:
            require_wandb()
        if train_cfg.tensorboard:
            check_tensorboard_target(train_cfg.run_dir)
    run_dir = runs.prepare_run_dir(train_cfg.run_dir)
    tokenizer = make_tokenizer(data_cfg)
    check_compatible(model_cfg, data_cfg, tokenizer)
    if data_cfg.batch_size % (train_cfg.grad_accum * process[1]):
        raise ValueError(f"DataConfig.batch_size={data_cfg.batch_size} must be a multiple of "
                         f"TrainConfig.grad_accum={train_cfg.grad_accum} x {process[1]} processes")

    topics = run_topics(model_cfg, data_cfg, run_dir, log=say, save=is_main)   # DoE's Stage 1
    dataset = train_dataset(data_cfg, tokenizer, process_index=process[0], process_count=process[1],
                            topics=topics)
    evaluator = _Evaluator(data_cfg, train_cfg, tokenizer, topics)
    mesh = make_mesh(train_cfg.mesh)
    note = schedule_note(optim_cfg, train_cfg.steps)
    if note:
        say(note)
    model, optimizer, schedule = build(model_cfg, optim_cfg, train_cfg, mesh, log=say)
    say(f"model settled for {jax.default_backend()}: "
        f"{describe_settled(model.cfg, model_cfg, layout=MeshLayout.of(mesh))}")
    data_iter = iter(dataset)

    meta = runs.model_meta(model_cfg)
    checkpointer = Checkpointer(run_dir / runs.CHECKPOINT_DIR, save_every=train_cfg.save_every,
                                keep=train_cfg.keep_checkpoints,
                                async_save=train_cfg.async_checkpoint)
    with activate(mesh):
        restored = checkpointer.restore(_abstract(_train_state(model, optimizer)),
                                        data_iterator=data_iter, expected_meta=meta)
    start = 0
    if restored is not None:
        for message in restored.skipped:
            say(f"warning: {message}")
        model_changes, data_changes = runs.resume_changes(run_dir, model_cfg, data_cfg,
                                                          restored.meta)
        if model_changes and not train_cfg.allow_model_change:
            checkpointer.close()
            raise ValueError(f"the model config differs from the checkpoint's in {run_dir}: "
                             f"{'; '.join(model_changes)}: resume with the run's own config, "
                             f"start a new --run_dir, or bind TrainConfig.allow_model_change=True "
                             f"to resume with the change")
        for change in model_changes:
            say(f"warning: resuming with a changed model (allow_model_change): {change}")
        for change in data_changes:
            say(f"warning: {change} since the run last started: the data position restored "
                f"comes from the earlier pipeline")
        nnx.update(model, restored.state["model"])
        nnx.update(optimizer, restored.state["optimizer"])
        start = restored.step
        say(f"resumed from step {start} in {run_dir}")
        if start >= train_cfg.steps:
            say(f"warning: the checkpoint is at step {start} and TrainConfig.steps="
                f"{train_cfg.steps}: nothing left to train (raise steps to continue)")
    if is_main:
        runs.save_configs(run_dir, model_cfg, data_cfg, optim_cfg, train_cfg, settled=model.cfg)
        if operative_gin:
            (run_dir / "operative_config.gin").write_text(operative_gin)

    writer = MetricsWriter(run_dir, enabled=is_main, tensorboard=train_cfg.tensorboard,
                           resume_step=start, wandb_project=train_cfg.wandb_project,
                           wandb_mode=train_cfg.wandb_mode,
                           config=runs.configs_to_json(model_cfg, data_cfg, optim_cfg, train_cfg))
    step_fn = make_train_step(grad_accum=train_cfg.grad_accum,
                              wrt=TRAINABLE[train_cfg.trainable], donate=True)
    tokens_per_step = data_cfg.batch_size * data_cfg.seq_len
    losses: Dict[int, float] = {}
    stop = {}
    step = start
    final_eval: Dict[str, float] = {}
    # The bar starts once the first step has compiled, so its rate and ETA leave compilation
    # out; so does tokens/s (the window restarts then). Without the bar (``progress=False``,
    # cluster logs), a plain line every ``log_every`` steps says the same.
    bar = _progress(train_cfg.steps, start, False)
    clock = _Clock(train_cfg.steps)
    # SIGTERM / SIGINT only set ``stop`` from here until the last checkpoint has committed and
    # the final evaluation is done, so a second signal cannot kill a save in flight, and
    # "saved" is said only once the save is on disk.
    with _stop_on_signals(stop):
        try:
            with activate(mesh):
                window_start, window_steps = time.perf_counter(), 0
                for step in range(start + 1, train_cfg.steps + 1):
                    batch = next(data_iter)
                    check_tokens(batch, model_cfg.vocab_size)
                    device_batch = _device_batch(batch, mesh)
                    if not clock.compiled:
                        say(f"step {step}: compiling the training step...")
                        clock.begin()
                    metrics = step_fn(model, optimizer, device_batch)
                    loss = float(metrics["loss"])
                    if not math.isfinite(loss):
                        raise NonFiniteLossError(
                            f"loss is {loss} at step {step}: stopped without saving; the newest "
                            f"checkpoint in {run_dir / 'checkpoints'} is the last good one (lower "
                            f"OptimConfig.learning_rate or raise grad clipping)")
                    losses[step] = loss
                    if not clock.compiled:
                        say(f"step {step}: compiled the training step in "
                            f"{clock.mark_compiled(step):.1f} s")
                        bar = _progress(train_cfg.steps, step, progress and is_main)
                        window_start, window_steps = time.perf_counter(), 0
                    else:
                        window_steps += 1
                        bar.update(1)
                    if step % train_cfg.log_every == 0 or step == train_cfg.steps:
                        elapsed = time.perf_counter() - window_start
                        host = jax.device_get(metrics)
                        host["learning_rate"] = float(schedule(step - 1))
                        if window_steps:                 # not the compiling step alone
                            host["tokens_per_sec"] = (tokens_per_step * window_steps
                                                      / max(elapsed, 1e-9))
                        writer.write(step, host)
                        shown = {k: f"{v:.2f}" for k, v in
                                 summarise_load(host.get("expert_load")).items()}
                        if "tokens_per_sec" in host:
                            shown["tok_s"] = f"{host['tokens_per_sec']:.0f}"
                        bar.set_postfix(loss=f"{loss:.3f}", **shown, refresh=False)
                        if not (progress and is_main):
                            say(f"step {step}/{train_cfg.steps}: loss {loss:.4f}, lr "
                                f"{host['learning_rate']:.3g}" + "".join(
                                    f", {k} {v}" for k, v in shown.items())
                                + clock.eta(step))
                        window_start, window_steps = time.perf_counter(), 0
                    if (train_cfg.eval_every and step % train_cfg.eval_every == 0
                            and step < train_cfg.steps):
                        result = evaluator(model)
                        writer.write(step, result, prefix="eval/")
                        if progress and is_main:
                            bar.write(f"step {step}: " + _format_eval(result))
                        else:
                            say(f"step {step}: " + _format_eval(result))
                        window_start, window_steps = time.perf_counter(), 0
                    checkpointer.check_for_errors()      # stop at a failed save, not later
                    force = bool(stop) or step == train_cfg.steps
                    if force or checkpointer.should_save(step):   # gather the state only then
                        _check_saveable(model, device_batch, step, run_dir)
                        checkpointer.save(step, _train_state(model, optimizer),
                                          data_iterator=data_iter, meta=meta, force=force)
                    if stop:
                        break
            bar.close()
            checkpointer.wait()                  # committed before anything says it is saved
            if stop:
                say(f"{stop['signal']} received: saved a checkpoint at step {step} in "
                    f"{run_dir / 'checkpoints'}; run the same command again to resume")
            else:
                with activate(mesh):
                    final_eval = evaluator(model)
                if step > start or not _has_eval_record(run_dir, step):
                    writer.write(step, final_eval, prefix="eval/")   # not again on re-evaluation
                baseline = unigram_entropy(data_cfg, tokenizer)
                final_eval["unigram_baseline"] = baseline
                say(f"final eval at step {step}: " + _format_eval(final_eval))
        finally:
            bar.close()
            checkpointer.close()                 # waits for (and checksums) a pending save
            writer.close()
    return RunResult(run_dir=str(run_dir), step=step, resumed_from=start or None,
                     interrupted=bool(stop), eval=final_eval, losses=losses)


class _Clock:
    """Training time without the first step's compilation, for the ETA of plain log lines."""

    def __init__(self, total: int):
        self.total = total
        self.compiled = False
        self._start = time.perf_counter()
        self._step = 0

    def begin(self) -> None:
        """The first step starts (compiling first)."""
        self._start = time.perf_counter()

    def mark_compiled(self, step: int) -> float:
        """The first step (compile + run) is done; returns its seconds."""
        now = time.perf_counter()
        seconds = now - self._start
        self.compiled, self._start, self._step = True, now, step
        return seconds

    def eta(self, step: int) -> str:
        """', ETA 1m05s' from the rate since compilation ('' before two steps have run)."""
        done = step - self._step
        if not self.compiled or done <= 0 or step >= self.total:
            return ""
        left = int(round((time.perf_counter() - self._start) / done * (self.total - step)))
        return f", ETA {left // 60}m{left % 60:02d}s"


def _has_eval_record(run_dir, step: int) -> bool:
    """Whether ``metrics.jsonl`` already holds the evaluation of ``step`` (a finished run
    started again only re-evaluates: its record is not written twice)."""
    return any(r.get("step") == step and "eval/loss" in r for r in read_metrics(run_dir))


def _check_saveable(model, device_batch, step: int, run_dir: Path) -> None:
    """Refuse to checkpoint parameters that have diverged. The loss of step k is computed
    before its update, so a finite loss says nothing about the parameters the update produced
    (a huge learning rate gave a finite loss at one step, parameters of 1e5 after it and NaN at
    the next). Their loss on the step's own batch must be finite before they are saved as
    "the last good" state."""
    out = eval_step(model, device_batch)
    loss = float(out["ce_sum"]) / max(float(out["tokens"]), 1.0)
    if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"the parameters after step {step} give a loss of {loss}: stopped without saving "
            f"them; the newest checkpoint in {run_dir / 'checkpoints'} is the last good one "
            f"(lower OptimConfig.learning_rate or raise grad clipping)")


def _format_eval(result: Dict[str, float]) -> str:
    text = f"held-out loss {result['loss']:.4f} (perplexity {result['perplexity']:.3f})"
    if "unigram_baseline" in result:
        text += f" vs unigram baseline {result['unigram_baseline']:.4f} nats/token"
    if "exact_match" in result:
        per_task = ", ".join(f"{k.split('/', 1)[1]} {100 * v:.1f}%" for k, v in result.items()
                             if k.startswith("exact_match/"))
        text += f"; exact answers {100 * result['exact_match']:.1f}% ({per_task})"
    return text


# DataConfig fields an evaluation of a finished run may change: what is scored and how it is
# read, not what the model was trained on or how text becomes tokens.
EVAL_DATA_FIELDS = ("eval_source", "eval_split", "text_key", "tfds_data_dir", "tokenizer_path",
                    "seq_len", "batch_size", "num_synthetic_eval", "task_min_size",
                    "task_max_size", "worker_count")


def eval_data_overrides(bindings: Iterable[str]) -> Dict[str, object]:
    """The DataConfig changes that ``--gin.DataConfig.field=value`` bindings ask of an
    evaluation (``--mode=eval``), as {field: value}. A binding of a field outside
    :data:`EVAL_DATA_FIELDS` or of another class, and a value that is not a literal (an
    unquoted string), are one-line ``ValueError``s."""
    import ast  # pylint: disable=import-outside-toplevel

    changes: Dict[str, object] = {}
    for binding in bindings:
        name, _, value = (part.strip() for part in binding.partition("="))
        cls, _, field = name.rpartition(".")
        if cls != "DataConfig" or field not in EVAL_DATA_FIELDS:
            raise ValueError(
                f"--mode=eval takes the run's own config; of the bindings only DataConfig."
                f"{{{','.join(EVAL_DATA_FIELDS)}}} apply at evaluation, not {name}")
        try:
            changes[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"gin binding {name} = {value}: a string needs quotes in gin: "
                             f"write --gin.{name}=\"'{value}'\"") from None
    return changes


def evaluate_checkpoint(run_dir: str | Path, *, eval_source: str = "", eval_split: str = "",
                        eval_batches_limit: int = 0, data_overrides: Optional[dict] = None,
                        log: Callable[[str], None] = print) -> Dict[str, float]:
    """Load the newest checkpoint of ``run_dir`` and report held-out loss / perplexity on
    ``eval_source`` (a DataConfig source spec; empty = the run's own held-out split).
    ``data_overrides``: other DataConfig changes for the evaluation (from
    :func:`eval_data_overrides`), applied before ``eval_source`` / ``eval_split``."""
    _, data_cfg, _, _ = runs.load_configs(run_dir)
    changes = dict(data_overrides or {})
    if eval_source:
        changes["eval_source"] = eval_source
    if eval_split:
        changes["eval_split"] = eval_split
    data_cfg = dataclasses.replace(data_cfg, **changes)
    # The devices here need not be the ones the run trained on: the checkpoint is restored
    # into this process's default mesh (all devices data-parallel).
    mesh = make_mesh(MeshConfig())
    loaded = runs.load_run(run_dir, mesh=mesh, data_cfg=data_cfg, log=log)
    check_compatible(loaded.model_cfg, data_cfg, loaded.tokenizer)
    for message in loaded.warnings:
        log(f"warning: {message}")
    train_cfg = dataclasses.replace(loaded.train_cfg, eval_batches=eval_batches_limit)
    with activate(mesh):
        topics = run_topics(loaded.model_cfg, data_cfg, run_dir, save=False)
        result = _Evaluator(data_cfg, train_cfg, loaded.tokenizer, topics)(loaded.model)
    result["step"] = loaded.step
    log(f"eval of {run_dir} at step {loaded.step} on "
        f"{data_cfg.eval_source or data_cfg.source + ' (held-out)'}: " + _format_eval(result))
    return result
