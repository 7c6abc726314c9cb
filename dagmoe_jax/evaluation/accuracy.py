"""Exact-answer accuracy on the synthetic DP tasks.

* :func:`exact_match`: per row, whether every answer token is the prediction;
* :func:`per_task_accuracy`: those verdicts as accuracy per task and overall;
* :func:`task_accuracy`: a model's exact answers on task batches
  (:func:`~dagmoe_jax.data.task_eval_batches`), overall and per task.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence

import numpy as np

from dagmoe_jax import run as run_lib
from dagmoe_jax.evaluation.step import eval_step
from dagmoe_jax.model import Transformer
from dagmoe_jax.run.extensions import extension_for


def exact_match(predictions: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per row: every masked target equals the prediction (bool [B]).

    ``predictions`` are ids [B, S] or logits [B, S, V] (argmax taken). On task batches this is
    greedy decoding's exact answer: with teacher forcing, each answer token is predicted from
    the correct prefix, and the row is right iff all of them are.
    """
    predictions, targets, mask = map(np.asarray, (predictions, targets, mask))
    if predictions.ndim == targets.ndim + 1:
        predictions = predictions.argmax(-1)
    return np.all((predictions == targets) | ~mask.astype(bool), axis=-1)


def per_task_accuracy(correct: np.ndarray, task_id: np.ndarray, tasks: Sequence[str]) -> dict:
    """``{task: accuracy}`` plus ``'all'``, from concatenated :func:`exact_match` results and
    ``task_id`` of the batches; tasks without examples are left out."""
    correct, task_id = np.asarray(correct, bool), np.asarray(task_id)
    result = {"all": float(correct.mean()) if correct.size else float("nan")}
    for k, name in enumerate(tasks):
        rows = task_id == k
        if rows.any():
            result[name] = float(correct[rows].mean())
    return result


def task_accuracy(model: Transformer, batches: Iterable[Dict[str, np.ndarray]],
                  names: List[str]) -> Dict[str, float]:
    """Exact-answer accuracy (greedy answer == reference) overall and per synthetic task."""
    right, total = np.zeros(len(names)), np.zeros(len(names))
    keys = extension_for(model.cfg).batch_keys
    for batch in batches:
        predictions = np.asarray(eval_step(model, run_lib.replicated_batch(batch, keys))
                                      ["predictions"])
        correct = exact_match(predictions, batch["targets"], batch["mask"])
        np.add.at(right, batch["task_id"], correct)
        np.add.at(total, batch["task_id"], 1)
    result = {"exact_match": float(right.sum() / max(total.sum(), 1))}
    for name, r, t in zip(names, right, total):
        if t:
            result[f"exact_match/{name}"] = float(r / t)
    return result

