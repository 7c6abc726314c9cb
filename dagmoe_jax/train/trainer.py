"""The Trainer: restore or initialise, step, and run hooks every few steps (Levanter's shape).

``Trainer`` owns what every training run does the same way: the resume policy, the jitted
step over a data iterator, the non-finite guards, the checkpoints and the signals. What a run
reports is hooks (:mod:`dagmoe_jax.train.hooks`: metrics and progress, evaluation), each called
with a :class:`StepInfo` every ``every`` steps and on the last one::

    trainer = Trainer(model, optimizer, step_fn, data_iter, checkpointer, total_steps=1000)
    trainer.add_hook(my_hook, every=100)
    start = trainer.restore_or_init(check=lambda restored: ...)
    step, interrupted = trainer.run(start)

Nothing is lost on interruption: SIGTERM or Ctrl-C finishes the current step, saves a
checkpoint (with the data iterator's position) and returns; a run started again continues
exactly where it stopped, to the bit on CPU. A non-finite loss, or parameters whose loss is
not finite, stop the run without saving, so the newest checkpoint is the last good one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
from flax import nnx

from dagmoe_jax import run as run_lib
from dagmoe_jax.parallel import activate
from dagmoe_jax.evaluation import eval_step


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the newest checkpoint on disk is the last good one."""


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step: its number, metrics (on the device), the time the step
    itself took (data, dispatch, and on a step that waits for the device, the compute queued
    since the last such step; not the hooks), and whether it is the last one. ``loss`` reads
    the loss to the host: a hook that reads it every step makes every step wait."""

    step: int
    metrics: Dict[str, Any]
    seconds: float
    last: bool

    @property
    def loss(self) -> float:
        return float(self.metrics["loss"])


class Trainer:
    """Steps ``model`` and ``optimizer`` with ``step_fn`` over ``data_iter`` (module docstring).

    checkpointer: the run's :class:`~dagmoe_jax.run.Checkpointer`; meta: what checkpoints
    are saved with and checked against; say: one-line reports (compilation, resume, stop
    reasons); run_dir: named in them;
    batch_keys: the per-token annotations of a model family the batches carry to the model;
    sync_every: the host reads the losses (and stops at a non-finite one) every this many
    steps, before every checkpoint and at the end, not every step: between two reads the
    host queues steps while the device computes (``RunConfig.log_every`` in a run);
    epochs: the run's ``RunConfig.epochs`` when they sized ``total_steps`` (0: the steps
    did), named when a checkpoint has nothing left to train.
    """

    def __init__(self, model, optimizer, step_fn: Callable, data_iter, checkpointer, *,
                 total_steps: int, mesh=None, meta: Optional[dict] = None,
                 run_dir: str = "",
                 say: Callable[[str], None] = lambda _message: None,
                 batch_keys: Tuple[str, ...] = (), sync_every: int = 1, epochs: int = 0):
        self.model, self.optimizer, self.step_fn = model, optimizer, step_fn
        self.data_iter, self.checkpointer = data_iter, checkpointer
        self.total_steps, self.mesh, self.meta = total_steps, mesh, meta or {}
        self.run_dir, self.say = run_dir, say
        self.batch_keys, self.sync_every = batch_keys, max(int(sync_every), 1)
        self.epochs = epochs
        self.hooks: List[Tuple[int, Callable[[StepInfo], None]]] = []
        self.losses: Dict[int, float] = {}
        self.compile_seconds: Optional[float] = None

    def add_hook(self, hook: Callable[[StepInfo], None], every: int = 1) -> None:
        """Call ``hook(info)`` after every ``every``-th step and after the last (``every`` 0:
        never)."""
        if every:
            self.hooks.append((every, hook))

    def mesh_scope(self):
        return contextlib.nullcontext() if self.mesh is None else activate(self.mesh)

    def restore_or_init(self, check: Callable[[run_lib.Restored], None] = lambda _r: None) -> int:
        """Restore the newest readable checkpoint into the model, optimizer and data iterator
        and return its step, or 0 for a new run. A checkpoint of the parameters alone (the
        step 0 of an upcycle or an import) leaves the optimizer's fresh state as built.
        ``check(restored)`` runs first and may refuse (raise) a checkpoint the run's configs
        must not continue."""
        abstract = run_lib.abstract(run_lib.train_state(self.model, self.optimizer))
        with self.mesh_scope():
            restored = self.checkpointer.restore(abstract, data_iterator=self.data_iter,
                                                 expected_meta=self.meta)
        if restored is None:
            return 0
        for message in restored.skipped:
            self.say(f"warning: {message}")
        check(restored)
        nnx.update(self.model, restored.state["model"])
        fresh = "optimizer" not in restored.state        # an upcycled run's step 0
        if not fresh:
            nnx.update(self.optimizer, restored.state["optimizer"])
        self.say(f"resumed from step {restored.step} in {self.run_dir}"
                 + (" (parameters only: fresh optimizer state)" if fresh else ""))
        if restored.step >= self.total_steps:
            sized = (f"RunConfig.epochs={self.epochs} ends at step {self.total_steps}"
                     if self.epochs else f"RunConfig.steps={self.total_steps}")
            self.say(f"warning: the checkpoint is at step {restored.step} and {sized}: nothing "
                     f"left to train (raise {'epochs' if self.epochs else 'steps'} to continue)")
        return restored.step

    def run(self, start: int, stop: Optional[dict] = None) -> Tuple[int, bool]:
        """Train from ``start`` to ``total_steps``; (the last step reached, interrupted).

        ``stop``: the flag dict that SIGTERM / SIGINT set
        (:func:`~dagmoe_jax.train.signals.on_signals`): the step in progress finishes, a
        checkpoint is saved and the run returns; a signal landing after the step's save
        decision is acted on at the next step. Checkpoints are committed before this returns,
        so "saved" is said only once a save is on disk."""
        stop = {} if stop is None else stop
        step = start
        pending: List[Tuple[int, Any]] = []     # (step, loss on the device) not yet read
        with self.mesh_scope():
            for step in range(start + 1, self.total_steps + 1):
                tick = time.perf_counter()
                batch = next(self.data_iter)
                device_batch = run_lib.device_batch(batch, self.mesh, self.batch_keys)
                if self.compile_seconds is None:
                    self.say(f"step {step}: compiling the training step...")
                metrics = self.step_fn(self.model, self.optimizer, device_batch)
                if "mask" in device_batch:          # the loss is a mean over these tokens
                    metrics = {**metrics, "trained_tokens": _count(device_batch["mask"])}
                pending.append((step, metrics["loss"]))
                last = step == self.total_steps
                if last or self.compile_seconds is None or step % self.sync_every == 0:
                    self._read_losses(pending)
                seconds = time.perf_counter() - tick
                if self.compile_seconds is None:
                    self.compile_seconds = seconds
                    self.say(f"step {step}: compiled the training step in {seconds:.1f} s")
                info = StepInfo(step, metrics, seconds, last)
                for every, hook in self.hooks:
                    if step % every == 0 or last:
                        hook(info)
                self.checkpointer.check_for_errors()     # stop at a failed save, not later
                # the flag read once, after the hooks: a signal landing later is the next step's
                stopping = bool(stop.get("signal"))
                force = stopping or last
                if force or self.checkpointer.should_save(step):  # gather the state only then
                    self._read_losses(pending)           # no save after a non-finite loss
                    self.check_saveable(device_batch, step)
                    self.checkpointer.save(step, run_lib.train_state(self.model, self.optimizer),
                                                data_iterator=self.data_iter, meta=self.meta,
                                                force=force)
                if stopping:
                    break
        self.checkpointer.wait()
        return step, bool(stop.get("signal"))

    def _read_losses(self, pending: List[Tuple[int, Any]]) -> None:
        """Wait for the queued steps and read their losses, emptying ``pending``; the first
        non-finite one stops the run without saving (no checkpoint is written between two
        reads)."""
        steps, losses = [s for s, _ in pending], jax.device_get([v for _, v in pending])
        pending.clear()
        for step, loss in zip(steps, losses):
            loss = float(loss)
            if not math.isfinite(loss):
                raise NonFiniteLossError(
                    f"loss is {loss} at step {step}: stopped without saving; the newest "
                    f"checkpoint in {self.checkpointer.directory} is the last good one "
                    f"(lower OptimConfig.learning_rate or raise grad clipping)")
            self.losses[step] = loss

    def check_saveable(self, device_batch, step: int) -> None:
        """Refuse to checkpoint parameters that have diverged. The loss of step k is computed
        before its update, so a finite loss says nothing about the parameters the update
        produced (a huge learning rate gave a finite loss at one step, parameters of 1e5
        after it and NaN at the next). Their loss on the step's own batch must be finite
        before they are saved as "the last good" state."""
        out = eval_step(self.model, device_batch)
        loss = float(out["ce_sum"]) / max(float(out["tokens"]), 1.0)
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"the parameters after step {step} give a loss of {loss}: stopped without "
                f"saving them; the newest checkpoint in {self.checkpointer.directory} is the "
                f"last good one (lower OptimConfig.learning_rate or raise grad clipping)")


@jax.jit
def _count(mask):
    """The number of trained tokens (True entries) of a batch's mask, over all processes."""
    return jax.numpy.sum(mask, dtype=jax.numpy.int32)


def on_main_process(fn: Callable[[str], None]) -> Callable[[str], None]:
    """``fn`` on process 0, a no-op on the others (one report per multi-host run)."""
    return fn if jax.process_index() == 0 else (lambda _message: None)
