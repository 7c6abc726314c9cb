"""Evaluation: exact-answer scoring of the DP tasks, the reasoning suite and the quality
(perplexity) benchmark, over the variants of :mod:`dagmoe_jax.eval.variants`.

The command lines are ``benchmarks/reasoning.py`` and ``benchmarks/quality.py``; the modules
here compute and format, and never print.
"""

from dagmoe_jax.eval.dp_depth import dp_depth, dp_depth_closed_form
from dagmoe_jax.eval.scoring import (accuracy_by_size, eval_seq_len, mean_std, model_predictor,
                                     score_batches, score_by_size, seed_statistics)
from dagmoe_jax.eval.variants import VARIANTS, variant_config

__all__ = ["VARIANTS", "variant_config", "dp_depth", "dp_depth_closed_form", "accuracy_by_size",
           "eval_seq_len", "mean_std", "model_predictor", "score_batches", "score_by_size",
           "seed_statistics"]
