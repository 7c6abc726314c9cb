"""Evaluation of a model or a run: its one home, one module per idea.

* :mod:`~dagmoe_jax.evaluation.step`: :func:`token_scores`, the one loglikelihood function,
  and :func:`eval_step`, the jitted scoring of one batch (summed cross-entropy, token count,
  argmax predictions) that every evaluation below runs;
* :mod:`~dagmoe_jax.evaluation.heldout`: :func:`evaluate` (token-weighted held-out
  cross-entropy and perplexity), :class:`Evaluator` (it and task accuracy on a data config's
  held-out batches built once: what the training loop calls), :func:`format_eval`, and
  :func:`evaluate_checkpoint` (a run directory's newest checkpoint scored, ``train.py
  --mode=eval``, with the DataConfig changes :func:`eval_data_overrides` allows);
* :mod:`~dagmoe_jax.evaluation.accuracy`: exact-answer accuracy on the synthetic DP tasks
  (:func:`exact_match`, :func:`per_task_accuracy`, :func:`task_accuracy`);
* :mod:`~dagmoe_jax.evaluation.scoring`: :class:`Scorer`, loglikelihoods and continuations of
  token ids for any model of the library, batched so that no score depends on the batching
  (what the lm-evaluation-harness adapter, :mod:`dagmoe_jax.harness`, answers requests with; no
  harness needed), with :func:`padded_width` (the compiled width of a batch of rows) and the
  memory a scoring call needs (:func:`program_bytes`, :func:`free_device_bytes`).

The benchmark drivers that train and compare models live apart, in ``benchmarks/experiments/``.
"""

from dagmoe_jax.evaluation.accuracy import exact_match, per_task_accuracy, task_accuracy
from dagmoe_jax.evaluation.heldout import (EVAL_OVERRIDABLE_FIELDS, Evaluator,
                                           eval_data_overrides, evaluate, evaluate_checkpoint,
                                           format_eval)
from dagmoe_jax.evaluation.scoring import (MIN_WIDTH, Scorer, free_device_bytes, padded_width,
                                           program_bytes)
from dagmoe_jax.evaluation.step import eval_step, token_scores

__all__ = ["token_scores", "eval_step", "evaluate", "Evaluator", "format_eval",
           "EVAL_OVERRIDABLE_FIELDS", "eval_data_overrides", "evaluate_checkpoint",
           "exact_match", "per_task_accuracy", "task_accuracy", "Scorer", "MIN_WIDTH",
           "padded_width", "program_bytes", "free_device_bytes"]
