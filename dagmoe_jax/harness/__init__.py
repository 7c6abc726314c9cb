"""Downstream evaluation through lm-evaluation-harness (the optional extra ``[harness]``).

* :mod:`~dagmoe_jax.harness.scoring`: :class:`Scorer`, loglikelihoods and continuations of
  token ids for any model of the library (no harness needed);
* :mod:`~dagmoe_jax.harness.lm`: the harness's ``LM`` for a run directory, registered as
  ``dagmoe``;
* ``python -m dagmoe_jax.harness`` (console script ``dagmoe-harness``): the harness's usual
  flags on a run directory (:mod:`~dagmoe_jax.harness.cli`).
"""

from dagmoe_jax.harness.scoring import Scorer, padded_width

__all__ = ["Scorer", "padded_width"]
