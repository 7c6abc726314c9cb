"""The Trainer's host reads: the losses are read every ``sync_every`` steps, before every
checkpoint and at the end, not after every step; a non-finite loss still stops the run before
anything is saved, naming the step that produced it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dagmoe_jax.train.trainer import NonFiniteLossError, Trainer


class Loss:
    """A step's loss that records when the host reads it."""
    reads: list = []

    def __init__(self, step: int, value: float):
        self.step, self.value = step, value

    def __float__(self):
        Loss.reads.append(self.step)
        return self.value


class Checkpoints:
    directory = "fake"

    def __init__(self, save_at=()):
        self.save_at, self.saved, self.read_at_save = set(save_at), [], []

    def check_for_errors(self):
        pass

    def should_save(self, step):
        return step in self.save_at

    def save(self, step, *_args, **_kwargs):
        self.saved.append(step)
        self.read_at_save.append(len(Loss.reads))

    def wait(self):
        pass


def _trainer(losses, checkpoints, sync_every):
    calls = iter(range(1, len(losses) + 1))
    step_fn = lambda _m, _o, _b: (lambda s: {"loss": Loss(s, losses[s - 1])})(next(calls))  # noqa: E731
    batches = iter([{"inputs": np.zeros((1, 4), np.int32)}] * len(losses))
    trainer = Trainer(None, None, step_fn, batches, checkpoints, total_steps=len(losses),
                      sync_every=sync_every)
    trainer.check_saveable = lambda *_a: None
    Loss.reads = []
    return trainer


def test_losses_are_read_every_sync_every_steps_and_at_the_end():
    checkpoints = Checkpoints(save_at={6})
    trainer = _trainer([1.0] * 10, checkpoints, sync_every=4)
    seen = []
    trainer.add_hook(lambda info: seen.append(info.step), every=1)
    assert trainer.run(0) == (10, False)
    # step 1 (compile time), 4 (sync), 6 (before its checkpoint), 8 (sync), 10 (the last)
    assert Loss.reads == list(range(1, 11)) and sorted(trainer.losses) == list(range(1, 11))
    assert checkpoints.saved == [6, 10] and seen == list(range(1, 11))
    assert checkpoints.read_at_save == [6, 10]        # every loss up to a checkpoint read first


def test_reads_are_batched_between_syncs():
    trainer = _trainer([1.0] * 8, Checkpoints(), sync_every=4)
    order = []
    trainer.add_hook(lambda info: order.append(("hook", info.step, len(Loss.reads))), every=1)
    trainer.run(0)
    # after step 2 and 3 nothing new was read; after step 4 steps 2..4 were
    assert [n for _, _, n in order] == [1, 1, 1, 4, 4, 4, 4, 8]


def test_a_non_finite_loss_stops_before_the_next_checkpoint():
    losses = [1.0] * 10
    losses[5] = math.nan                                     # step 6
    checkpoints = Checkpoints(save_at={7})
    trainer = _trainer(losses, checkpoints, sync_every=4)
    with pytest.raises(NonFiniteLossError, match="at step 6: stopped without saving"):
        trainer.run(0)
    assert checkpoints.saved == [] and max(Loss.reads) == 6


def test_a_signal_during_the_hooks_still_saves_that_step():
    """SIGTERM may arrive at any moment of a step, the hooks included: the step it arrived in
    is saved before the run returns."""
    checkpoints = Checkpoints()
    trainer = _trainer([1.0] * 10, checkpoints, sync_every=4)
    stop = {}
    trainer.add_hook(lambda info: stop.setdefault("signal", "SIGTERM") if info.step == 3
                     else None, every=1)
    assert trainer.run(0, stop) == (3, True)
    assert checkpoints.saved == [3] and sorted(trainer.losses) == [1, 2, 3]


def test_a_signal_after_the_save_decision_is_saved_at_the_next_step():
    """A signal landing between the step's save decision and its end (here: while the
    interval policy is asked) is not taken for a stop that was saved: the run goes on to the
    next step, saves that one and returns it (CI: 'saved a checkpoint at step 1', and none on
    disk)."""
    stop = {}

    class SignalledWhileDeciding(Checkpoints):
        def should_save(self, step):
            if step == 3:
                stop.setdefault("signal", "SIGTERM")
            return super().should_save(step)

    checkpoints = SignalledWhileDeciding()
    trainer = _trainer([1.0] * 10, checkpoints, sync_every=4)
    assert trainer.run(0, stop) == (4, True)
    assert checkpoints.saved == [4]


@pytest.mark.parametrize("disable", [False, True])
def test_progress_lines_say_the_eta_even_when_tqdm_is_disabled(monkeypatch, disable):
    """Without the bar (``progress=False``) each logged line ends with the ETA, counted from
    the steps since the bar started; with ``TQDM_DISABLE=1`` tqdm disables the bar, which then
    keeps no start step (the ETA read off it failed: int - None)."""
    from dagmoe_jax.train import hooks
    from dagmoe_jax.train.trainer import StepInfo

    class Disabled(hooks.tqdm):          # as TQDM_DISABLE=1 makes every bar
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    if disable:
        monkeypatch.setattr(hooks, "tqdm", Disabled)
    lines = []

    class Writer:
        def write(self, step, host):
            pass

    hook = hooks.ProgressHook(Writer(), lambda _s: 1e-3, total_steps=10, tokens_per_step=8,
                              log_every=2, show=False, say=lines.append)
    for step in range(1, 5):
        hook(StepInfo(step=step, metrics={"loss": np.float32(2.5)}, seconds=0.01,
                      last=False))
    assert [line.split(":")[0] for line in lines] == ["step 2/10", "step 4/10"]
    assert all("loss 2.5000" in line and ", ETA " in line for line in lines)
