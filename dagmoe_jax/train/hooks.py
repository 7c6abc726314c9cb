"""The training loop's hooks: what a run reports while it trains (:class:`~.trainer.Trainer`).

* :class:`ProgressHook` (every step): the tqdm bar (step, loss, expert load, tokens/s, ETA),
  and, every ``log_every`` steps, a metrics record (``metrics.jsonl``, TensorBoard, W&B) and,
  without the bar (``progress=False``, cluster logs), a plain line saying the same. tqdm is
  the one clock: the bar's rate gives the ETA of the plain lines too.
* :class:`EvalHook` (every ``eval_every`` steps but the last, which the run's final
  evaluation scores): held-out loss and perplexity, written and reported.

Tokens/s count the steps' own time (data and compute), never compilation, evaluation or
checkpoint saves.
"""

from __future__ import annotations

import io
import time
from typing import Callable, Optional

import jax
from tqdm.auto import tqdm

from dagmoe_jax.evaluation import format_eval
from dagmoe_jax.train.metrics import MetricsWriter, summarise_load
from dagmoe_jax.train.trainer import StepInfo


class ProgressHook:
    """The progress bar and the metric records (module docstring).

    The bar starts at the first step after compilation, so its rate and ETA leave compilation
    out; hidden (``show=False``) it still keeps the rate for the plain lines' ETA."""

    def __init__(self, writer: MetricsWriter, schedule: Callable, *, total_steps: int,
                 tokens_per_step: int, log_every: int, show: bool,
                 say: Callable[[str], None]):
        self.writer, self.schedule, self.total = writer, schedule, total_steps
        self.tokens_per_step, self.log_every, self.show, self.say = (
            tokens_per_step, log_every, show, say)
        self.bar: Optional[tqdm] = None
        self.window_seconds, self.window_steps = 0.0, 0
        self.first_step, self.step, self.started = 0, 0, 0.0

    def __call__(self, info: StepInfo) -> None:
        self.step = info.step
        if self.bar is None:               # the first step, compiled: the bar starts here
            self.bar = tqdm(total=self.total, initial=info.step, unit="step",
                            dynamic_ncols=True, mininterval=1.0, smoothing=0.1,
                            file=None if self.show else io.StringIO())
            self.first_step, self.started = info.step, time.perf_counter()
        else:
            self.bar.update(1)
            self.window_seconds += info.seconds
            self.window_steps += 1
        if info.step % self.log_every == 0 or info.last:
            self.log(info)

    def log(self, info: StepInfo) -> None:
        host = jax.device_get(info.metrics)
        host["learning_rate"] = float(self.schedule(info.step - 1))
        if self.window_steps:                                # not the compiling step alone
            host["tokens_per_sec"] = (self.tokens_per_step * self.window_steps
                                      / max(self.window_seconds, 1e-9))
        self.writer.write(info.step, host)
        shown = {k: f"{v:.2f}" for k, v in summarise_load(host.get("expert_load")).items()}
        if "tokens_per_sec" in host:
            shown["tok_s"] = f"{host['tokens_per_sec']:.0f}"
        loss = float(host["loss"])                           # read with the metrics above
        self.bar.set_postfix(loss=f"{loss:.3f}", **shown, refresh=False)
        if not self.show:
            self.say(f"step {info.step}/{self.total}: loss {loss:.4f}, lr "
                     f"{host['learning_rate']:.3g}" + "".join(f", {k} {v}" for k, v in
                                                                shown.items()) + self.eta())
        self.window_seconds, self.window_steps = 0.0, 0

    def eta(self) -> str:
        """', ETA 01:05' from the steps and time since the bar started ('' before a step has
        run under it, and at the end). Counted here, not read off the bar: a bar that tqdm
        disables (``TQDM_DISABLE=1``) keeps no start step."""
        done, left = self.step - self.first_step, self.total - self.step
        elapsed = time.perf_counter() - self.started
        if done <= 0 or left <= 0 or elapsed <= 0:
            return ""
        return f", ETA {tqdm.format_interval(elapsed / done * left)}"

    def write(self, text: str) -> None:
        """A line above the bar (or a plain line without it)."""
        if self.show and self.bar is not None:
            self.bar.write(text)
        else:
            self.say(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class EvalHook:
    """Held-out evaluation every ``every`` steps (module docstring)."""

    def __init__(self, evaluator: Callable, model, writer: MetricsWriter,
                 progress: ProgressHook):
        self.evaluator, self.model, self.writer, self.progress = (evaluator, model, writer,
                                                                  progress)

    def __call__(self, info: StepInfo) -> None:
        if info.last or not getattr(self.evaluator, "enabled", True):
            return                         # the final evaluation scores the last step
        result = self.evaluator(self.model)
        self.writer.write(info.step, result, prefix="eval/")
        self.progress.write(f"step {info.step}: " + format_eval(result))
