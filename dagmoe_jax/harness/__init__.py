"""Downstream evaluation through lm-evaluation-harness (the optional extra ``[harness]``).

The adapter only: requests are answered by :class:`dagmoe_jax.evaluation.scoring.Scorer`
(loglikelihoods and continuations of token ids for any model of the library, no harness
needed).

* :mod:`~dagmoe_jax.harness.lm`: the harness's ``LM`` for a run directory, registered as
  ``dagmoe``;
* :mod:`~dagmoe_jax.harness.task_loading`: which tasks the harness can see, loaded once with
  one-line errors;
* ``python -m dagmoe_jax.harness`` (console script ``dagmoe-harness``): the harness's usual
  flags on a run directory (:mod:`~dagmoe_jax.harness.cli`).
"""
