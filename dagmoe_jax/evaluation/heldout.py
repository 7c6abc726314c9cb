"""Held-out evaluation of a model or a run.

* :func:`evaluate`: token-weighted held-out cross-entropy (nats/token) and perplexity, by
  :func:`~dagmoe_jax.evaluation.step.eval_step`;
* :class:`Evaluator`: it and exact-answer accuracy on the synthetic DP tasks
  (:func:`~dagmoe_jax.evaluation.accuracy.task_accuracy`), on a data config's held-out batches
  built once (what the training loop calls every ``RunConfig.eval_every`` steps and at the
  end), and :func:`format_eval`, the line that reports them;
* :func:`evaluate_checkpoint`: the newest checkpoint of a run directory scored on its own
  held-out data or another source (``train.py --mode=eval``), with the DataConfig changes an
  evaluation may make (:func:`eval_data_overrides`).

The benchmark drivers that train and compare models live apart, in ``benchmarks/experiments/``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

import numpy as np

from dagmoe_jax import run as run_lib
from dagmoe_jax.data.splits import has_eval_data
from dagmoe_jax.hf.run import open_run, run_data_config
from dagmoe_jax.data import DataConfig, eval_batches, task_eval_batches, task_names
from dagmoe_jax.evaluation.accuracy import task_accuracy
from dagmoe_jax.evaluation.step import eval_step
from dagmoe_jax.model import Transformer
from dagmoe_jax.parallel import MeshConfig, activate, make_mesh
from dagmoe_jax.run.config import RunConfig
from dagmoe_jax.run.extensions import extension_for
from dagmoe_jax.run.gin import binding_values


def evaluate(model: Transformer, batches: Iterable[Dict[str, np.ndarray]]) -> Dict[str, float]:
    """Token-weighted held-out cross-entropy (nats/token) and perplexity over ``batches``."""
    ce_sum, tokens = 0.0, 0.0
    keys = extension_for(model.cfg).batch_keys
    for batch in batches:
        out = eval_step(model, run_lib.replicated_batch(batch, keys))
        ce_sum += float(out["ce_sum"])
        tokens += float(out["tokens"])
    if tokens == 0:
        raise ValueError("the evaluation data has no tokens: check DataConfig.eval_source / "
                         "heldout_fraction")
    loss = ce_sum / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


class Evaluator:
    """Held-out perplexity (+ exact-answer accuracy on synthetic tasks), data built once."""

    def __init__(self, data_cfg: DataConfig, run_cfg: RunConfig, tokenizer, annotate=None):
        # Every process evaluates the whole (small) held-out set, replicated on its devices.
        # None: no evaluation data (DataConfig.heldout_fraction = 0 and no eval_source).
        self.batches = (eval_batches(data_cfg, tokenizer,
                                     max_batches=run_cfg.eval_batches or None,
                                     annotate=annotate)
                        if has_eval_data(data_cfg) else None)
        self.task_batches, self.task_names = [], []
        kind = data_cfg.source.split(":", 1)[0]
        if run_cfg.task_eval_examples and kind == "synthetic" and not data_cfg.eval_source:
            self.task_names = list(task_names(data_cfg))
            self.task_batches = task_eval_batches(data_cfg, tokenizer,
                                                  num_examples=run_cfg.task_eval_examples,
                                                  batch_size=data_cfg.batch_size)

    @property
    def enabled(self) -> bool:
        """Whether there is held-out data to evaluate."""
        return self.batches is not None

    def __call__(self, model) -> Dict[str, float]:
        if not self.enabled:
            return {}
        result = evaluate(model, self.batches)
        if self.task_batches:
            result.update(task_accuracy(model, self.task_batches, self.task_names))
        return result


def format_eval(result: Dict[str, float]) -> str:
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
EVAL_OVERRIDABLE_FIELDS = ("eval_source", "eval_split", "text_key", "tfds_data_dir",
                           "tokenizer_path", "seq_len", "batch_size", "num_synthetic_eval",
                           "task_min_size", "task_max_size", "worker_count")


def eval_data_overrides(bindings: Iterable[str]) -> Dict[str, object]:
    """The DataConfig changes that ``--gin.DataConfig.field=value`` bindings ask of an
    evaluation (``--mode=eval``), as {field: value}, read by gin's parser
    (:func:`~dagmoe_jax.run.gin.binding_values`). A binding of a field outside
    :data:`EVAL_OVERRIDABLE_FIELDS` or of another class, and one gin cannot read (an unquoted
    string), are one-line ``ValueError``s."""
    changes: Dict[str, object] = {}
    for name, value in binding_values(bindings):
        cls, _, field = name.rpartition(".")
        if cls != "DataConfig" or field not in EVAL_OVERRIDABLE_FIELDS:
            raise ValueError(
                f"--mode=eval takes the run's own config; of the bindings only DataConfig."
                f"{{{','.join(EVAL_OVERRIDABLE_FIELDS)}}} apply at evaluation, not {name}")
        changes[field] = value
    return changes


def evaluate_checkpoint(run_dir: str | Path, *, eval_source: str = "", eval_split: str = "",
                        eval_batches_limit: int = 0, data_overrides: Optional[dict] = None,
                        log: Callable[[str], None] = lambda _message: None
                        ) -> Dict[str, float]:
    """Load the newest checkpoint of ``run_dir`` (or ``hf:FOLDER``) and report held-out loss /
    perplexity on ``eval_source`` (a DataConfig source spec; empty = the run's own held-out
    split) to ``log`` (default: nothing; ``train.py --mode=eval`` prints).
    ``data_overrides``: other DataConfig changes for the evaluation (from
    :func:`eval_data_overrides`), applied before ``eval_source`` / ``eval_split``."""
    data_cfg = run_data_config(run_dir)
    changes = dict(data_overrides or {})
    if eval_source:
        changes["eval_source"] = eval_source
    if eval_split:
        changes["eval_split"] = eval_split
    data_cfg = dataclasses.replace(data_cfg, **changes)
    if not has_eval_data(data_cfg):
        raise ValueError(f"the run at {run_dir} trained on all of its data (heldout_fraction "
                         "0): pass --eval_source=SPEC to evaluate it")
    # The devices here need not be the ones the run trained on: the checkpoint is restored
    # into this process's default mesh (all devices data-parallel).
    mesh = make_mesh(MeshConfig())
    loaded = open_run(run_dir, mesh=mesh, data_cfg=data_cfg, log=log)
    run_lib.check_compatible(loaded.model_cfg, data_cfg, loaded.tokenizer)
    for message in loaded.warnings:
        log(f"warning: {message}")
    run_cfg = dataclasses.replace(loaded.run_cfg, eval_batches=eval_batches_limit)
    with activate(mesh):
        annotate = extension_for(loaded.model_cfg).prepare_run(data_cfg, run_dir, save=False)
        result = Evaluator(data_cfg, run_cfg, loaded.tokenizer, annotate)(loaded.model)
    result["step"] = loaded.step
    log(f"eval of {run_dir} at step {loaded.step} on "
        f"{data_cfg.eval_source or data_cfg.source + ' (held-out)'}: " + format_eval(result))
    return result
