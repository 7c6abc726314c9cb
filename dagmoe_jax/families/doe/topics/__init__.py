"""DoE Stage 1: the LDA knowledge space (DoE sec. 3.2, Appendix A.2; docs/design.md section 6).

* :mod:`~dagmoe_jax.families.doe.topics.lda`: fit scikit-learn's online
  ``LatentDirichletAllocation`` over the training documents (:func:`fit_topics`), save it with its
  vocabulary as a run artifact and load it back (:class:`TopicModel`).
* :mod:`~dagmoe_jax.families.doe.topics.assign`: per token, the causal input topic id fed to the
  model and the expert label ``y_t = argmax_k theta_(d,k) beta_(k,w_t)`` (:func:`token_topics`), and
  the incremental :class:`TopicTracker` that generation uses.
* :mod:`~dagmoe_jax.families.doe.topics.stage`: the run's Stage 1 (fitted once, saved in the run
  directory); :mod:`~dagmoe_jax.families.doe.extension`: DoE's hooks into the run (the topic
  ids in every batch, DoE's loss, the topics tracked while generating).

The DoE block itself is :mod:`dagmoe_jax.families.doe`.
"""

from dagmoe_jax.families.doe.topics.assign import TopicTracker, piece_table, token_topics
from dagmoe_jax.families.doe.topics.lda import TopicConfig, TopicModel, fit_topics, word_spans

__all__ = ["TopicConfig", "TopicModel", "TopicTracker", "fit_topics", "piece_table",
           "token_topics", "word_spans"]
