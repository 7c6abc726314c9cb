"""The hooks through which a block family reaches the run around the model.

Most blocks need nothing beyond the token stream. A family that does (DoE: a topic model
fitted before training, per-token topic ids in every batch, an extra loss term, topic ids
tracked while decoding) implements :class:`Extension`, and the training loop, the step, the
data pipeline, evaluation and generation call these hooks without naming the family:

* :meth:`Extension.prepare_run`: before any data is built, fit or load what the run needs
  (saved in the run directory) and return the :class:`Annotator` the data pipeline applies to
  every record (None: plain batches);
* :meth:`Extension.model_inputs`: the model call's extra arguments for a batch;
* :meth:`Extension.loss`: the training objective from the cross-entropy and the model's
  auxiliary outputs, with the metrics it logs;
* :meth:`Extension.decoding_features`: what generation tracks while decoding (a
  :class:`FeatureTracker`), built from a run directory, its data config and tokenizer.

The table of the families that have one, and :func:`~dagmoe_jax.run.extensions.extension_for`
(the no-op :class:`Extension` itself for every other block), are where the run is built
(:mod:`dagmoe_jax.run.extensions`); the model never names its extension.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Protocol, Sequence, Tuple

import jax
import numpy as np


class Annotator(Protocol):
    """Per-token arrays added to every record by the data pipeline and carried through
    packing, shuffling, batching and checkpoints with the tokens.

    keys: the names of the arrays (batch keys); pad: each key's value where a batch position
    holds no token (packing and batch padding); ``annotator(ids)``: a record's arrays, each
    aligned with ``ids`` (its tokens, EOS included)."""

    keys: Tuple[str, ...]
    pad: Dict[str, int]

    def __call__(self, ids: Sequence[int]) -> Dict[str, np.ndarray]:
        ...


class FeatureTracker(Protocol):
    """Per-token model features that generation tracks on the host while it decodes.

    ``prompt(tokens, lengths)``: the features of right-padded prompts [B, P] (as the model
    call's ``features``: int [B, P, ...]); ``step(tokens)``: the features [B, 1, ...] of the
    tokens [B] just generated (each with the trailing shape of its prompt feature), which the
    next step feeds the model."""

    def prompt(self, tokens: np.ndarray, lengths: np.ndarray) -> Dict[str, np.ndarray]:
        ...

    def step(self, tokens: np.ndarray) -> Dict[str, np.ndarray]:
        ...


class Extension:
    """A block family's hooks (module docstring); this base class needs nothing.

    batch_keys: the per-token annotations (its annotator's keys) that batches carry to the
    model and its loss."""

    batch_keys: Tuple[str, ...] = ()

    def __init__(self, model_cfg):
        self.model_cfg = model_cfg

    def prepare_run(self, data_cfg, run_dir, *, log: Callable[[str], None] = lambda _m: None,
                    save: bool = True) -> Optional[Annotator]:
        """Fit or load what the run needs before its data (``save``: keep it in ``run_dir``;
        False for tools that only read a run); the data pipeline's annotator, or None."""
        del data_cfg, run_dir, log, save
        return None

    def model_inputs(self, batch: dict, *, train: bool) -> dict:
        """The model call's extra keyword arguments for ``batch`` (``train``: a training step,
        which may draw noise)."""
        del batch, train
        return {}

    def loss(self, ce: jax.Array, aux: dict, batch: dict) -> Tuple[jax.Array, dict]:
        """(training loss, extra metrics) from the cross-entropy and the model's ``aux``: by
        default ce plus the routers' weighted auxiliary losses."""
        del batch
        return ce + aux["aux_loss"], {}

    def decoding_features(self, run_dir, data_cfg, tokenizer) -> Optional[FeatureTracker]:
        """What generation tracks for a model of this family loaded from ``run_dir`` (with
        its data config and tokenizer; None: nothing)."""
        del run_dir, data_cfg, tokenizer
        return None


