"""Online LDA over the training documents (DoE sec. 3.2, Appendix A.2, Appendix F.1).

The LDA itself is scikit-learn's ``LatentDirichletAllocation`` (online variational Bayes,
Hoffman et al. 2010; DoE Appendix F.1: "a distributed Online LDA"): nothing here re-implements
it. This module decides what a *word* is, fits the model, and stores it with its vocabulary as
a run artifact (:meth:`TopicModel.save` / :meth:`TopicModel.load`: NumPy arrays and JSON, no
pickle, so an artifact loads under any scikit-learn version that has the estimator).

Words (our reading; the paper does not say): maximal ASCII runs ``\\b[A-Za-z][A-Za-z0-9_]+\\b``
of the utf-8 bytes, lower-cased, at least two characters, scikit-learn's English stop words
removed, and only the ``vocab_size`` most frequent that occur in at least ``min_df`` documents.
Anything else (punctuation, numbers, non-ASCII text, rare words) is not a word: its tokens get
the null topic id (:mod:`dagmoe_jax.families.doe.topics.assign`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from dagmoe_jax.families.doe.config import TopicConfig
from dagmoe_jax.validate import positive as _positive

# scikit-learn's E-step (``transform``) runs through its joblib wrapper; called from the data
# pipeline's reader threads it warns, once per process, that its configuration cannot follow the
# thread. Nothing here depends on that configuration, so this one message is silenced.
warnings.filterwarnings("ignore", message=r".*sklearn\.utils\.parallel\.delayed.*",
                        category=UserWarning)

WORD_PATTERN = re.compile(rb"\b[A-Za-z][A-Za-z0-9_]+\b")
ARTIFACT_ARRAYS = "topics.npz"
ARTIFACT_VOCAB = "vocabulary.json"
ARTIFACT_INFO = "topics.json"


def _as_bytes(text: Union[str, bytes]) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8")


def word_spans(data: bytes) -> List[Tuple[int, int, str]]:
    """The words of ``data`` as (start byte, end byte, lower-cased word), in order."""
    return [(m.start(), m.end(), m.group().decode("ascii").lower())
            for m in WORD_PATTERN.finditer(data)]


class _Analyzer:
    """CountVectorizer analyzer: a document's words (picklable, unlike a lambda)."""

    def __init__(self, stop_words: frozenset):
        self.stop_words = stop_words

    def __call__(self, text) -> List[str]:
        return [w for _, _, w in word_spans(_as_bytes(text)) if w not in self.stop_words]


def _stop_words(use: bool) -> frozenset:
    if not use:
        return frozenset()
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS  # pylint: disable=import-outside-toplevel
    return frozenset(ENGLISH_STOP_WORDS)


class TopicModel:
    """A fitted LDA: K topics over a word vocabulary.

    ``components`` [K, V] is scikit-learn's ``components_`` (the variational parameters lambda
    of the topic-word Dirichlets); ``beta`` [K, V] is each row normalised, beta_(k,w) = p(w | k).
    ``null_id`` = K is the topic id of tokens outside every vocabulary word.
    """

    def __init__(self, vocabulary: Sequence[str], components: np.ndarray, doc_topic_prior: float,
                 topic_word_prior: float, stop_words: bool, info: Optional[dict] = None):
        self.vocabulary = list(vocabulary)
        self.index = {w: i for i, w in enumerate(self.vocabulary)}
        self.components = np.asarray(components, np.float64)
        if self.components.shape[1] != len(self.vocabulary):
            raise ValueError(f"topic model: components have {self.components.shape[1]} words, "
                             f"the vocabulary {len(self.vocabulary)}")
        self.doc_topic_prior = float(doc_topic_prior)
        self.topic_word_prior = float(topic_word_prior)
        self.stop_words = bool(stop_words)
        self.info = dict(info or {})
        self.beta = self.components / self.components.sum(axis=1, keepdims=True)
        # r(w)_k = beta_(k,w) / sum_j beta_(j,w): a word's topic responsibilities under a flat
        # document prior (the causal input ids accumulate these; assign.py).
        self.responsibility = (self.beta / self.beta.sum(axis=0, keepdims=True)).T   # [V, K]
        self._lda = None

    @property
    def num_topics(self) -> int:
        return self.components.shape[0]

    @property
    def null_id(self) -> int:
        return self.num_topics

    def _estimator(self):
        """The scikit-learn estimator rebuilt from the stored arrays (for ``transform``)."""
        if self._lda is None:
            from scipy.special import psi  # pylint: disable=import-outside-toplevel
            from sklearn.decomposition import LatentDirichletAllocation  # pylint: disable=import-outside-toplevel

            lda = LatentDirichletAllocation(n_components=self.num_topics,
                                            doc_topic_prior=self.doc_topic_prior,
                                            topic_word_prior=self.topic_word_prior)
            lda.components_ = self.components
            comp = self.components
            lda.exp_dirichlet_component_ = np.exp(psi(comp) - psi(comp.sum(1))[:, None])
            lda.doc_topic_prior_ = self.doc_topic_prior
            lda.topic_word_prior_ = self.topic_word_prior
            lda.n_features_in_ = comp.shape[1]
            lda.n_batch_iter_ = 1
            lda.n_iter_ = 1
            lda.bound_ = 0.0
            self._lda = lda
        return self._lda

    def counts(self, documents: Iterable[Union[str, bytes]]):
        """Sparse document-word count matrix [D, V] over this model's vocabulary."""
        from scipy.sparse import csr_matrix  # pylint: disable=import-outside-toplevel

        documents = list(documents)
        rows, cols = [], []
        for d, doc in enumerate(documents):
            for _, _, w in word_spans(_as_bytes(doc)):
                j = self.index.get(w)
                if j is not None:
                    rows.append(d)
                    cols.append(j)
        data = np.ones(len(rows), np.float64)
        return csr_matrix((data, (rows, cols)), shape=(len(documents), len(self.vocabulary)))

    def theta(self, documents: Sequence[Union[str, bytes]]) -> np.ndarray:
        """Document-topic distributions theta_d [D, K] (scikit-learn's E-step, normalised)."""
        return self._estimator().transform(self.counts(documents))

    def theta_of_words(self, indices: Sequence[int]) -> np.ndarray:
        """theta [K] of one document given as the vocabulary indices of its words (repeats
        count): ``theta([document])[0]`` for a caller that has already found the words."""
        from scipy.sparse import csr_matrix  # pylint: disable=import-outside-toplevel

        cols = np.asarray(indices, np.int64)
        row = csr_matrix((np.ones(len(cols)), (np.zeros(len(cols), np.int64), cols)),
                         shape=(1, len(self.vocabulary)))
        return self._estimator().transform(row)[0]

    def top_words(self, n: int = 10) -> List[List[str]]:
        """The ``n`` most probable words of each topic."""
        order = np.argsort(-self.beta, axis=1)[:, :n]
        return [[self.vocabulary[j] for j in row] for row in order]

    def save(self, directory: str) -> None:
        """Write the artifact: ``topics.npz`` (arrays), ``vocabulary.json``, ``topics.json``
        (priors, fit settings and each topic's top words, for people)."""
        os.makedirs(directory, exist_ok=True)
        np.savez(os.path.join(directory, ARTIFACT_ARRAYS), components=self.components)
        with open(os.path.join(directory, ARTIFACT_VOCAB), "w", encoding="utf-8") as f:
            json.dump(self.vocabulary, f)
        info = dict(self.info, num_topics=self.num_topics, doc_topic_prior=self.doc_topic_prior,
                    topic_word_prior=self.topic_word_prior, stop_words=self.stop_words,
                    top_words=self.top_words())
        with open(os.path.join(directory, ARTIFACT_INFO), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)

    @classmethod
    def load(cls, directory: str) -> "TopicModel":
        """The artifact :meth:`save` wrote; a one-line error if it is missing or incomplete."""
        paths = [os.path.join(directory, n) for n in (ARTIFACT_ARRAYS, ARTIFACT_VOCAB, ARTIFACT_INFO)]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"topic model {directory!r} is incomplete: {missing[0]} is missing "
                             "(fit one with dagmoe_jax.families.doe.topics.fit_topics and save it there)")
        with np.load(paths[0]) as arrays:
            components = arrays["components"]
        with open(paths[1], encoding="utf-8") as f:
            vocabulary = json.load(f)
        with open(paths[2], encoding="utf-8") as f:
            info = json.load(f)
        return cls(vocabulary, components, info["doc_topic_prior"], info["topic_word_prior"],
                   info["stop_words"], {k: v for k, v in info.items() if k == "fit"})


def fit_topics(documents: Sequence[Union[str, bytes]], num_topics: int,
               cfg: TopicConfig = TopicConfig()) -> TopicModel:
    """Fit online LDA with ``num_topics`` topics on ``documents`` (DoE Appendix A.2).

    Raises a one-line ``ValueError`` when the documents hold no vocabulary words (e.g.
    synthetic digit tasks): DoE's topics need text.
    """
    from sklearn.decomposition import LatentDirichletAllocation  # pylint: disable=import-outside-toplevel
    from sklearn.feature_extraction.text import CountVectorizer  # pylint: disable=import-outside-toplevel

    _positive("fit_topics", "num_topics", num_topics)
    docs = list(documents)
    if cfg.max_documents:
        docs = docs[:cfg.max_documents]
    min_df = cfg.min_df if len(docs) >= cfg.min_df else 1
    vectorizer = CountVectorizer(analyzer=_Analyzer(_stop_words(cfg.stop_words)),
                                 max_features=cfg.vocab_size, min_df=min_df)
    try:
        counts = vectorizer.fit_transform(docs)
    except ValueError as e:
        raise ValueError(f"no words to fit topics on ({len(docs)} documents; {e}): DoE needs "
                         "text documents (a 'text:' / 'jsonl:' / 'tfds:' source)") from None
    prior = lambda v: v if v > 0 else 1.0 / num_topics
    lda = LatentDirichletAllocation(
        n_components=num_topics, learning_method="online", max_iter=cfg.max_iter,
        batch_size=cfg.batch_size, learning_decay=cfg.learning_decay,
        learning_offset=cfg.learning_offset, doc_topic_prior=prior(cfg.doc_topic_prior),
        topic_word_prior=prior(cfg.topic_word_prior), total_samples=counts.shape[0],
        random_state=cfg.seed, n_jobs=1)
    lda.fit(counts)
    info = {"fit": dict(dataclasses.asdict(cfg), documents=len(docs),
                        perplexity=float(lda.perplexity(counts)))}
    return TopicModel(vectorizer.get_feature_names_out().tolist(), lda.components_,
                      lda.doc_topic_prior_, lda.topic_word_prior_, cfg.stop_words, info)
