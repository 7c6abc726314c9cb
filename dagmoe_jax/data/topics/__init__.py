"""DoE Stage 1: the LDA knowledge space (DoE sec. 3.2, Appendix A.2; docs/design.md section 6).

* :mod:`~dagmoe_jax.data.topics.lda`: fit scikit-learn's online ``LatentDirichletAllocation`` over the
  training documents (:func:`fit_topics`), save it with its vocabulary as a run artifact and load
  it back (:class:`TopicModel`).
* :mod:`~dagmoe_jax.data.topics.assign`: per token, the causal input topic id fed to the model and the
  expert label ``y_t = argmax_k theta_(d,k) beta_(k,w_t)`` (:func:`token_topics`), and the
  incremental :class:`TopicTracker` that generation uses.
"""

from dagmoe_jax.data.topics.assign import TopicTracker, piece_table, token_topics
from dagmoe_jax.data.topics.lda import TopicConfig, TopicModel, fit_topics, word_spans

__all__ = ["TopicConfig", "TopicModel", "TopicTracker", "fit_topics", "piece_table",
           "token_topics", "word_spans"]
