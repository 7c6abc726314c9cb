"""Training a run: ``train(...)`` runs (or resumes) the run in ``RunConfig.run_dir``.

It is what ``train.py`` calls, and it works from a notebook. The pieces are elsewhere: the
run directory and the model are built by :mod:`dagmoe_jax.run`, stepped by a
:class:`~dagmoe_jax.train.trainer.Trainer` (resume, checkpoints, signals, divergence guards),
reported by its hooks (:mod:`dagmoe_jax.train.hooks`) and evaluated by
:mod:`dagmoe_jax.evaluation`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional

import jax

from dagmoe_jax import run as run_lib
from dagmoe_jax.run.allocator import allocator
from dagmoe_jax.config import ModelConfig
from dagmoe_jax.model.settle import describe
from dagmoe_jax.data import DataConfig, make_tokenizer, train_dataset, unigram_entropy
from dagmoe_jax.data.instruct import instruct_dataset, instruct_stats, is_instruct
from dagmoe_jax.evaluation import Evaluator, format_eval
from dagmoe_jax.run.extensions import extension_for
from dagmoe_jax.parallel import make_mesh
from dagmoe_jax.parallel.state import batch_axes, batch_shards
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.run.paths import run_path
from dagmoe_jax.train.hooks import EvalHook, ProgressHook
from dagmoe_jax.train.metrics import MetricsWriter, check_tensorboard_target, require_wandb
from dagmoe_jax.run.records import read_metrics
from dagmoe_jax.run.config import OptimConfig, RunConfig
from dagmoe_jax.train.init_from import (load_initial_params, source_bindings,
                                         source_data_config, source_model_config)
from dagmoe_jax.run.optim import TRAINABLE, schedule_note
from dagmoe_jax.train.step import make_train_step
from dagmoe_jax.train.signals import Interrupted, check_interrupted, on_signals
from dagmoe_jax.train.trainer import NonFiniteLossError, Trainer, on_main_process

__all__ = ["Interrupted", "NonFiniteLossError", "RunResult", "train"]


@dataclasses.dataclass
class RunResult:
    """What ``train`` did: the last step reached, the final evaluation, and why it stopped."""

    run_dir: str
    step: int
    resumed_from: Optional[int]
    interrupted: bool
    eval: Dict[str, float]
    losses: Dict[int, float]


def train(model_cfg: ModelConfig, data_cfg: DataConfig, optim_cfg: OptimConfig,
          run_cfg: RunConfig, *, progress: bool = True,
          log: Callable[[str], None] = print, operative_gin: str = "",
          signals: Optional[dict] = None,
          started: Callable[[], None] = lambda: None) -> RunResult:
    """Train (or resume) the run in ``run_cfg.run_dir``; returns a :class:`RunResult`.

    ``log`` receives one-line reports (resume, evaluations, stop reasons); the progress bar
    shows step, loss, tokens/s and ETA. Raises
    :class:`~dagmoe_jax.train.trainer.NonFiniteLossError` on a NaN/inf loss, and
    :class:`~dagmoe_jax.train.signals.Interrupted` for SIGINT / SIGTERM before the first step.
    ``signals``: where a command's own signal handler recorded a signal received before this
    call (its exception may have been swallowed by a library's callback): one there stops the
    run before anything is written. ``started`` is called once the run's config is written:
    from then on a signal saves a checkpoint and stops (a command's own stop, which removes
    a new run directory at once, applies until then).
    """
    say, is_main = on_main_process(log), jax.process_index() == 0
    data_cfg = data_cfg.with_absolute_paths()    # the run is read from any directory
    if run_cfg.init_from:
        model_cfg = source_model_config(run_cfg.init_from, model_cfg)
        data_cfg = source_data_config(run_cfg.init_from, data_cfg,
                                      run_cfg.tokenizer_from_source)
        origin = ("from " + run_cfg.init_from if run_cfg.tokenizer_from_source
                  else "the gin config")
        say(f"tokenizer: {data_cfg.tokenizer}"
            f"{' ' + data_cfg.tokenizer_path if data_cfg.tokenizer_path else ''} ({origin})")
    # SIGTERM / SIGINT: until the run's config is written they interrupt at once (nothing is
    # worth saving yet), and a failure or a signal removes the run directory this call
    # created, so no empty or half-made run is left behind; from then on they only set
    # ``stop``: the step in flight finishes, a checkpoint is saved and committed, and further
    # signals cannot kill that save.
    stop: dict = {} if signals is None else signals
    check_interrupted(stop)
    with on_signals(stop):
        with on_signals(stop, interrupt=True), _new_run_directory(run_cfg.run_dir,
                                                                   remove=is_main):
            run = _start(model_cfg, data_cfg, optim_cfg, run_cfg, is_main, say)
            data_cfg = run.data_cfg
            try:
                check_interrupted(stop)        # a signal a library callback swallowed
                if is_main:
                    run_lib.save_configs(run.run_dir, model_cfg, data_cfg, optim_cfg,
                                         run.run_cfg, settled=run.model.execution)
                    if operative_gin and run_cfg.init_from:
                        operative_gin += source_bindings(run_cfg.init_from, model_cfg,
                                                         data_cfg)
                    run_lib.save_operative_gin(run.run_dir, operative_gin)
            except BaseException:
                run.trainer.checkpointer.close()
                raise
        started()
        run_cfg, trainer, start = run.run_cfg, run.trainer, run.start
        writer = MetricsWriter(run.run_dir, enabled=is_main, tensorboard=run_cfg.tensorboard,
                               resume_step=start, wandb_project=run_cfg.wandb_project,
                               wandb_mode=run_cfg.wandb_mode,
                               config=run_lib.configs_to_json(model_cfg, data_cfg, optim_cfg,
                                                                run_cfg))
        bar = ProgressHook(writer, run.schedule, total_steps=run_cfg.steps,
                           tokens_per_step=data_cfg.batch_size * data_cfg.seq_len,
                           log_every=run_cfg.log_every, show=progress and is_main, say=say)
        trainer.add_hook(bar)
        trainer.add_hook(EvalHook(run.evaluator, run.model, writer, bar),
                         every=run_cfg.eval_every)
        step, final_eval = start, {}
        try:
            step, interrupted = trainer.run(start, stop)
            bar.close()
            if interrupted:
                say(f"{stop['signal']} received: saved a checkpoint at step {step} in "
                    f"{run.run_dir / run_lib.CHECKPOINT_DIR}; run the same command again to "
                    "resume")
            elif not run.evaluator.enabled:
                say(f"trained to step {step}; no held-out evaluation "
                    "(DataConfig.heldout_fraction = 0 and no eval_source)")
            else:
                with trainer.mesh_scope():
                    final_eval = run.evaluator(run.model)
                if step > start or not _has_eval_record(run.run_dir, step):
                    writer.write(step, final_eval, prefix="eval/")   # not again on re-evaluation
                final_eval["unigram_baseline"] = unigram_entropy(data_cfg, run.tokenizer)
                say(f"final eval at step {step}: " + format_eval(final_eval))
        finally:
            bar.close()
            trainer.checkpointer.close()         # waits for (and checksums) a pending save
            writer.close()
    return RunResult(run_dir=str(run.run_dir), step=step, resumed_from=start or None,
                     interrupted=bool(stop.get("signal")), eval=final_eval,
                     losses=trainer.losses)


@dataclasses.dataclass
class _Started:
    """What :func:`_start` made of a run: its directory, tokenizer, data and settled train
    config, model,
    evaluation, schedule, the trainer and the step it starts from."""

    run_dir: Path
    tokenizer: object
    data_cfg: DataConfig
    run_cfg: RunConfig
    model: object
    evaluator: Evaluator
    schedule: object
    trainer: Trainer
    start: int


def _start(model_cfg, data_cfg, optim_cfg, run_cfg, is_main: bool, say) -> _Started:
    """Everything before the first step: the run directory, the data (checked), the model,
    the checkpointer, and the resumed or initial state."""
    run_dir, tokenizer, data_cfg, mesh = _prepare(model_cfg, data_cfg, run_cfg, is_main)
    annotate = extension_for(model_cfg).prepare_run(data_cfg, run_dir, log=say, save=is_main)
    dataset, run_cfg = _dataset(model_cfg, data_cfg, run_cfg, tokenizer, annotate, say)
    evaluator = Evaluator(data_cfg, run_cfg, tokenizer, annotate)
    if schedule_note(optim_cfg, run_cfg.steps):
        say(schedule_note(optim_cfg, run_cfg.steps))
    model, optimizer, schedule = run_lib.build(model_cfg, optim_cfg, run_cfg, mesh, log=say)
    how = describe(model_cfg, model.execution, run_cfg.execution,
                           layout=MeshLayout.of(mesh))
    say(f"model settled for {jax.default_backend()}: {how}; host memory: {allocator()}")
    checkpointer = run_lib.Checkpointer(run_dir / run_lib.CHECKPOINT_DIR,
                                        save_every=run_cfg.save_every,
                                        keep=run_cfg.keep_checkpoints,
                                        async_save=run_cfg.async_checkpoint)
    step_fn = make_train_step(grad_accum=run_cfg.grad_accum,
                              wrt=TRAINABLE[run_cfg.trainable], donate=True)
    trainer = Trainer(model, optimizer, step_fn, iter(dataset), checkpointer,
                      total_steps=run_cfg.steps, mesh=mesh, meta=run_lib.model_meta(model_cfg),
                      run_dir=str(run_dir), say=say,
                      batch_keys=extension_for(model_cfg).batch_keys,
                      sync_every=run_cfg.log_every, epochs=run_cfg.epochs)
    try:
        start = trainer.restore_or_init(
            check=lambda restored: _resume_policy(restored, run_dir, model_cfg, data_cfg,
                                                  run_cfg, say))
        if start == 0 and run_cfg.init_from:
            say(load_initial_params(model, run_cfg.init_from, log=say))
    except BaseException:
        checkpointer.close()
        raise
    return _Started(run_dir, tokenizer, data_cfg, run_cfg, model, evaluator, schedule,
                    trainer, start)


@contextlib.contextmanager
def _new_run_directory(path: str, remove: bool):
    """Within: an exception (a signal's KeyboardInterrupt too) removes the run directory
    ``path`` when it did not exist before (``remove``: this process is the one that writes),
    so that a run that never started leaves nothing behind. A directory that existed (a run
    to resume) is never touched."""
    target = Path(os.path.expanduser(path))
    existed = target.exists()
    try:
        yield
    except BaseException:
        if remove and not existed and target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        raise


def _dataset(model_cfg, data_cfg, run_cfg, tokenizer, annotate, say):
    """(the training stream, run_cfg): an ``instruct:`` source's SFT batches, ``epochs``
    passes (with ``steps`` derived and printed) or endless; else the pre-training stream.
    Either checks its batches' token ids against the model's vocabulary."""
    where = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                 vocab_size=model_cfg.vocab_size)
    if not is_instruct(data_cfg):
        if run_cfg.epochs:
            raise ValueError(f"RunConfig.epochs={run_cfg.epochs} needs an 'instruct:' "
                             f"DataConfig.source (it is {data_cfg.source!r}): bind "
                             "RunConfig.steps instead")
        # a mix: source's components are described as the stream opens them
        return (train_dataset(data_cfg, tokenizer, annotate=annotate, log=say, **where),
                run_cfg)
    if annotate is not None:
        raise ValueError("an 'instruct:' DataConfig.source cannot feed a model family with "
                         "per-token annotations (DoE): use a pre-training source")
    epochs = run_cfg.epochs or None
    stats = instruct_stats(data_cfg, tokenizer, epochs=epochs or 1,
                           process_count=where["process_count"])
    if stats["trained_tokens"] == 0:
        raise ValueError(f"no example of {data_cfg.source} has a trained token within "
                         f"seq_len + 1 = {data_cfg.seq_len + 1} tokens ({stats['truncated']:,} "
                         f"of {stats['examples']:,} examples are longer, cut before their "
                         "answers): raise DataConfig.seq_len or shorten the prompts")
    what = (f"fine-tuning data: {stats['examples']:,} examples ({stats['truncated']:,} "
            f"truncated to seq_len + 1 = {data_cfg.seq_len + 1} tokens), "
            f"{stats['trained_tokens']:,} trained tokens per epoch")
    if epochs:
        run_cfg = dataclasses.replace(run_cfg, steps=max(1, stats["batches"]))
        what += (f": {epochs} epochs = {run_cfg.steps:,} steps of {data_cfg.batch_size} "
                 f"{'rows' if data_cfg.packing else 'examples'}")
    say(what)
    return instruct_dataset(data_cfg, tokenizer, epochs=epochs, **where), run_cfg


def _prepare(model_cfg, data_cfg, run_cfg, is_main: bool):
    """(run directory, tokenizer, data config, mesh), after every check that can fail
    before anything is written: the run directory's filesystem, the mesh, the batch against
    its batch axes, the metric sinks, the data against the model, the batch against gradient
    accumulation and the processes. A fine-tuned run's
    data config reads the run's own copy of its source's tokenizer."""
    run_path(run_cfg.run_dir)                  # its filesystem is reachable (else one line)
    mesh = make_mesh(run_cfg.mesh)
    shards = batch_shards(mesh)
    if data_cfg.batch_size % shards:
        raise ValueError(f"DataConfig.batch_size={data_cfg.batch_size} is not a multiple of the "
                         f"{shards} devices of the batch mesh axes {batch_axes()}: bind a "
                         f"multiple of {shards}, or a MeshConfig with fewer devices on them")
    if is_main:                                  # sinks that cannot work: before anything is written
        if run_cfg.wandb_project:
            require_wandb()
        if run_cfg.tensorboard:
            check_tensorboard_target(run_cfg.run_dir)
    run_dir = run_lib.prepare_run_dir(run_cfg.run_dir)
    if run_cfg.init_from and is_main:
        # The source's tokenizer files go with the run, as an import's do: it reads text
        # after the source has moved.
        data_cfg = run_lib.copy_tokenizer(data_cfg, run_dir)
    tokenizer = make_tokenizer(data_cfg)
    run_lib.check_compatible(model_cfg, data_cfg, tokenizer)
    processes = jax.process_count()
    if data_cfg.batch_size % (run_cfg.grad_accum * processes):
        raise ValueError(f"DataConfig.batch_size={data_cfg.batch_size} must be a multiple of "
                         f"RunConfig.grad_accum={run_cfg.grad_accum} x {processes} processes")
    return run_dir, tokenizer, data_cfg, mesh


def _resume_policy(restored, run_dir, model_cfg, data_cfg, run_cfg, say) -> None:
    """Refuse a checkpoint of another model unless ``RunConfig.allow_model_change``; warn
    about an allowed model change and about data changes since the run last started."""
    model_changes, data_changes = run_lib.resume_changes(run_dir, model_cfg, data_cfg,
                                                           restored.meta)
    if model_changes and not run_cfg.allow_model_change:
        raise ValueError(f"the model config differs from the checkpoint's in {run_dir}: "
                         f"{'; '.join(model_changes)}: resume with the run's own config, "
                         f"start a new --run_dir, or bind RunConfig.allow_model_change=True "
                         f"to resume with the change")
    for change in model_changes:
        say(f"warning: resuming with a changed model (allow_model_change): {change}")
    for change in data_changes:
        say(f"warning: {change} since the run last started: the data position restored "
            f"comes from the earlier pipeline")


def _has_eval_record(run_dir, step: int) -> bool:
    """Whether ``metrics.jsonl`` already holds the evaluation of ``step`` (a finished run
    started again only re-evaluates: its record is not written twice)."""
    return any(r.get("step") == step and "eval/loss" in r for r in read_metrics(run_dir))
