"""Stage 1 inside a training run: the run's topic model, fitted once and kept in the run.

A DoE run (``block='doe'`` with ``DoEConfig.use_topics``) needs its topic model before its first
batch: :func:`run_topics` loads ``<run_dir>/topics`` when the run has one (a resume), else copies
``DataConfig.topics_dir`` (a model fitted earlier) into it, else fits online LDA on the run's
training documents (:func:`~dagmoe_jax.families.doe.topics.lda.fit_topics`) and saves it there. A
resume therefore always labels its data with the topics the run started with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from dagmoe_jax.families.doe.topics.lda import ARTIFACT_ARRAYS, TopicConfig, TopicModel, fit_topics
from dagmoe_jax.data.splits import train_source

RUN_TOPICS_DIR = "topics"


def training_documents(data_cfg, limit: int = 0) -> list:
    """The training records of ``data_cfg`` (held-out records excluded), up to ``limit``."""

    source = train_source(data_cfg)
    n = len(source) if not limit else min(limit, len(source))
    return [source[i] for i in range(n)]


def run_topics(model_cfg, data_cfg, run_dir, *, log: Callable[[str], None] = lambda _m: None,
               save: bool = True, cfg: TopicConfig = TopicConfig()) -> Optional[TopicModel]:
    """The topic model of a DoE run (None for other models and the no-LDA ablation)."""
    if model_cfg.block.kind != "doe" or not model_cfg.block.use_topics:
        return None
    k = model_cfg.block.num_topics
    target = Path(run_dir) / RUN_TOPICS_DIR
    if (target / ARTIFACT_ARRAYS).is_file():
        model = TopicModel.load(str(target))
        log(f"topics: {model.num_topics} LDA topics from {target}")
    elif getattr(data_cfg, "topics_dir", ""):
        model = TopicModel.load(data_cfg.topics_dir)
        log(f"topics: {model.num_topics} LDA topics from {data_cfg.topics_dir}")
    else:
        docs = training_documents(data_cfg, cfg.max_documents)
        log(f"topics: fitting online LDA, {k} topics, on {len(docs)} training documents")
        model = fit_topics(docs, k, cfg)
    if model.num_topics != k:
        raise ValueError(f"the topic model has {model.num_topics} topics but DoEConfig.num_topics="
                         f"{k}: fit one with {k} topics or set num_topics={model.num_topics}")
    if save and not (target / ARTIFACT_ARRAYS).is_file():
        model.save(str(target))
    return model
