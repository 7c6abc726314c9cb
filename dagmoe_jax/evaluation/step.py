"""The scoring of one batch, what every evaluation runs.

* :func:`token_scores`: the one loglikelihood function (per position the cross-entropy and the
  argmax prediction, the LM head a chunk of positions at a time);
* :func:`eval_step`: its jitted sums over a batch's mask (summed cross-entropy, token count,
  argmax predictions), which held-out evaluation (:mod:`~dagmoe_jax.evaluation.heldout`) and
  exact-answer accuracy (:mod:`~dagmoe_jax.evaluation.accuracy`) run.
"""

from __future__ import annotations

from typing import Dict, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.model import Transformer
from dagmoe_jax.model.tiled_loss import chunk_tokens, tiled_scores
from dagmoe_jax.parallel import replicated
from dagmoe_jax.run.extensions import extension_for


def token_scores(model: Transformer, inputs: jax.Array, targets: jax.Array,
                 **model_inputs) -> Tuple[jax.Array, jax.Array]:
    """The one loglikelihood function (training's held-out loss, ``--mode=eval``, the
    lm-eval harness): per position the cross-entropy -log p(targets | inputs so far) [B, S]
    float32 and the argmax prediction [B, S] int32, from the LM head applied a chunk of
    positions at a time (:func:`~dagmoe_jax.model.tiled_loss.tiled_scores`: no [B, S, V]
    logits). ``model_inputs``: the model's other arguments (``segment_ids``, a family's
    ``features``)."""
    h, _ = model(inputs, head=False, **model_inputs)
    return tiled_scores(h, model.lm_head[...].astype(h.dtype), targets,
                        chunk_tokens=chunk_tokens(model.execution))


@nnx.jit
def eval_step(model: Transformer, batch: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    """Summed cross-entropy (:func:`token_scores`) and token count over ``batch['mask']``, and
    the argmax predictions (for exact-answer scoring); ``batch['segment_ids']`` optional, as in
    :func:`~dagmoe_jax.train.step.lm_loss`."""
    inputs = extension_for(model.cfg).model_inputs(batch, train=False)
    losses, predictions = token_scores(model, batch["inputs"], batch["targets"],
                                       segment_ids=batch.get("segment_ids"), **inputs)
    mask = batch["mask"].astype(jnp.float32)
    return replicated({"ce_sum": jnp.sum(losses * mask), "tokens": jnp.sum(mask),
                        "predictions": predictions})
