"""Experiments: the drivers behind the benchmarks that train models and compare them.

The reasoning suite (exact-answer scoring of the DP tasks by problem size), the quality
(perplexity) benchmark and their offline corpora, over the equal-parameter variants of
:mod:`benchmarks.experiments.variants`. They train with the library's loop and score with its
evaluation (:mod:`dagmoe_jax.evaluation`, the held-out loss of any run); the command lines are
``python -m benchmarks.reasoning`` and ``python -m benchmarks.quality``. The modules here compute and format,
and never print.
"""

from benchmarks.experiments.dp_depth import dp_depth, dp_depth_closed_form
from benchmarks.experiments.scoring import (accuracy_by_size, eval_seq_len, mean_std,
                                            model_predictor, score_batches, score_by_size,
                                            seed_statistics)
from benchmarks.experiments.variants import VARIANTS, variant_config

__all__ = ["VARIANTS", "variant_config", "dp_depth", "dp_depth_closed_form", "accuracy_by_size",
           "eval_seq_len", "mean_std", "model_predictor", "score_batches", "score_by_size",
           "seed_statistics"]
