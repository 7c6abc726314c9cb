"""The language-modelling loss and a jitted training step.

loss = cross-entropy on non-padding tokens + aux_loss (balance + z-loss, weighted by the
router config's coefficients). Each term is returned separately for logging.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dagmoe_jax.model import Transformer


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean token cross-entropy over positions where ``mask`` is true (float32)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def lm_loss(model: Transformer, batch: Dict[str, jax.Array]) -> Tuple[jax.Array, dict]:
    """Next-token loss of ``batch['inputs']`` -> ``batch['targets']`` (``batch['mask']``
    optional, default all ones). Returns (total loss, metrics)."""
    logits, aux = model(batch["inputs"])
    mask = batch.get("mask", jnp.ones_like(batch["targets"], dtype=bool))
    ce = cross_entropy(logits, batch["targets"], mask)
    total = ce + aux["aux_loss"]
    metrics = {"loss": total, "ce_loss": ce, "balance_loss": aux["balance_loss"],
               "z_loss": aux["z_loss"], "expert_load": aux["expert_load"],
               "dropped_fraction": aux["dropped_fraction"]}
    return total, metrics


def make_train_step(loss_fn: Callable = lm_loss) -> Callable:
    """A jitted ``step(model, optimizer, batch) -> metrics`` updating both in place."""

    @nnx.jit
    def step(model: Transformer, optimizer: nnx.Optimizer, batch):
        (_, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        metrics["grad_norm"] = optax.global_norm(grads)
        return metrics

    return step
