"""DoE's hooks into the run around the model (:class:`~dagmoe_jax.data.extension.Extension`).

* the run's Stage 1: the topic model loaded from, or fitted and saved in, the run directory
  (:func:`~dagmoe_jax.families.doe.topics.stage.run_topics`), and the annotator that gives every
  record its tokens' causal input topic ids and LDA expert labels (``topics``, ``topic_labels``);
* the model's extra inputs (the batch's topic ids, the training noise key) and the composite
  loss of DoE eq. 4 (:mod:`dagmoe_jax.families.doe.objective`);
* generation's topic tracking: the causal topic id of each new token, from the text so far
  (:class:`~dagmoe_jax.families.doe.topics.TopicTracker`), and, with
  ``DoEConfig.first_input='theta'``, the running counts of the ids (``topic_counts``) that the first
  layer's VAE mixes.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np

from dagmoe_jax.data import make_tokenizer
from dagmoe_jax.families.doe import objective
from dagmoe_jax.families.doe.topics.assign import TopicTracker, token_topics
from dagmoe_jax.families.doe.topics.lda import TopicModel
from dagmoe_jax.families.doe.topics.stage import run_topics
from dagmoe_jax.data.extension import Extension

TOPIC_KEYS = ("topics", "topic_labels")


class TopicAnnotator:
    """A record's ``topics`` (the causal input topic id of each token; null K before any
    complete word) and ``topic_labels`` (``argmax_k theta_(d,k) beta_(k,w_t)``; -1 where a
    token is no word), from a topic model and the tokenizer's piece bytes (picklable, for
    grain's map). Padding: the null id and -1."""

    keys = TOPIC_KEYS

    def __init__(self, model: TopicModel, pieces: Sequence[bytes]):
        self.model, self.pieces = model, list(pieces)
        self.pad = {"topics": model.null_id, "topic_labels": -1}

    def __call__(self, ids: Sequence[int]) -> Dict[str, np.ndarray]:
        topics, labels = token_topics(self.model, ids, self.pieces)
        return {"topics": topics, "topic_labels": labels}


class TopicFeatures:
    """Generation's :class:`~dagmoe_jax.data.extension.FeatureTracker` for a DoE model: one
    :class:`TopicTracker` per row; the ids equal :func:`token_topics`'s on the same text.

    ``counts=True`` (``DoEConfig.first_input='theta'``) also gives ``topic_counts``
    [B, S, K + 1]: at each position the counts of the topic ids at it and before it (the running
    distribution :func:`~dagmoe_jax.families.doe.block.causal_topic_mixture` reads, which a decode
    step's one token cannot rebuild), carried per row across steps."""

    def __init__(self, model: TopicModel, pieces: Sequence[bytes], counts: bool = False):
        self.model, self.pieces, self.counts = model, list(pieces), counts
        self.trackers = []
        self.running = None

    def prompt(self, tokens: np.ndarray, lengths: np.ndarray) -> Dict[str, np.ndarray]:
        b, p = tokens.shape
        ids = np.full((b, p), self.model.null_id, np.int32)
        self.trackers = [TopicTracker(self.model, self.pieces) for _ in range(b)]
        for r, tracker in enumerate(self.trackers):
            for i, t in enumerate(tokens[r, :lengths[r]].tolist()):
                ids[r, i] = tracker.next_id()
                tracker.push(t)
        out = {"topics": ids}
        if self.counts:
            n = self.model.null_id + 1
            counts = np.cumsum(np.eye(n, dtype=np.int32)[ids], axis=1, dtype=np.int32)
            out["topic_counts"] = counts        # padding's null ids: after every real position
            last = np.maximum(np.asarray(lengths) - 1, 0)
            self.running = counts[np.arange(b), last] * (np.asarray(lengths) > 0)[:, None]
        return out

    def step(self, tokens: np.ndarray) -> Dict[str, np.ndarray]:
        ids = np.empty((len(self.trackers), 1), np.int32)
        for r, tracker in enumerate(self.trackers):
            ids[r, 0] = tracker.next_id()
            tracker.push(int(tokens[r]))
        out = {"topics": ids}
        if self.counts:
            self.running[np.arange(len(ids)), ids[:, 0]] += 1
            out["topic_counts"] = self.running[:, None].copy()
        return out


class DoEExtension(Extension):
    """The hooks of a ``block='doe'`` model (module docstring)."""

    batch_keys = TOPIC_KEYS

    def prepare_run(self, data_cfg, run_dir, *, log=lambda _m: None,
                    save: bool = True) -> Optional[TopicAnnotator]:
        topics = run_topics(self.model_cfg, data_cfg, run_dir, log=log, save=save)
        if topics is None:                       # the no-LDA ablation: plain batches
            return None
        return TopicAnnotator(topics, make_tokenizer(data_cfg).piece_bytes())

    def model_inputs(self, batch: dict, *, train: bool) -> dict:
        return objective.model_inputs(self.model_cfg, batch, train=train)

    def loss(self, ce, aux, batch):
        return objective.doe_objective(self.model_cfg, ce, aux, batch)

    def decoding_features(self, run_dir, data_cfg, tokenizer) -> Optional[TopicFeatures]:
        if not self.model_cfg.block.use_topics:
            return None
        topics = run_topics(self.model_cfg, data_cfg, run_dir, save=False)
        return TopicFeatures(topics, tokenizer.piece_bytes(),
                             counts=self.model_cfg.block.first_input == "theta")


# The family's hooks into the run (dagmoe_jax.config.families).
EXTENSION = DoEExtension
