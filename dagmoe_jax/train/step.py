"""The language-modelling loss and the jitted training step (the evaluation step is
:func:`dagmoe_jax.evaluation.eval_step`).

loss = cross-entropy on non-padding tokens + aux_loss (balance + z-loss, weighted by the
router config's coefficients; every block's auxiliary loss is in it), + DeepSeek-V3's
multi-token prediction term with ``ModelConfig.mtp`` (:func:`mtp_loss`). Each term is returned
separately for logging. The training loss's cross-entropy is vocabulary-tiled
(:mod:`dagmoe_jax.model.tiled_loss`): the model stops at its hidden states and the LM head runs
a chunk of positions at a time, never holding the [B, S, V] logits. A block family with its
own objective gives the model its extra inputs and turns the cross-entropy into its loss
through its extension's hooks (:mod:`dagmoe_jax.data.extension`: ``model_inputs``, ``loss``; their
metrics are logged beside these).
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dagmoe_jax.model import Transformer
from dagmoe_jax.run.extensions import extension_for
from dagmoe_jax.parallel import replicated
from dagmoe_jax.model.mtp import depth_targets
from dagmoe_jax.model.tiled_loss import chunk_tokens, tiled_cross_entropy


# The metric that carries the routers' assignments per expert from the loss to the step's
# selection-bias update (auxiliary-loss-free balancing); the step removes it from the metrics.
ROUTER_COUNTS = "router_counts"


def routers_train(model, wrt) -> bool:
    """Whether ``wrt`` (the trained parameters' filter) trains the routers' keys: the routers'
    selection biases move only then (frozen routers route as they were)."""
    return bool(jax.tree.leaves(nnx.state(model, nnx.All(wrt, nnx.PathContains("w_router")))))


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean token cross-entropy over positions where ``mask`` is true (float32), from whole
    logits: the plain version of :func:`~dagmoe_jax.model.tiled_loss.tiled_cross_entropy`
    (its test oracle and the memory benchmark's baseline)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def lm_loss(model: Transformer, batch: Dict[str, jax.Array]) -> Tuple[jax.Array, dict]:
    """Next-token loss of ``batch['inputs']`` -> ``batch['targets']`` (``batch['mask']``
    optional, default all ones; ``batch['segment_ids']`` optional: the segment ids [B, S] of packed
    examples, the model's ``segment_ids``; ``batch['ce_tokens']`` optional: the token count the
    cross-entropy's sum is divided by, what gradient accumulation gives each micro-batch).
    Returns (total loss, metrics)."""
    extension = extension_for(model.cfg)
    h, aux = model(batch["inputs"], head=False, segment_ids=batch.get("segment_ids"),
                   **extension.model_inputs(batch, train=True))
    mask = batch.get("mask", jnp.ones_like(batch["targets"], dtype=bool))
    ce = tiled_cross_entropy(h, model.lm_head[...].astype(h.dtype), batch["targets"], mask,
                             chunk_tokens=chunk_tokens(model.execution),
                             tokens=batch.get("ce_tokens"))
    total, extra_metrics = extension.loss(ce, aux, batch)
    metrics = {"loss": total, "ce_loss": ce, "balance_loss": aux["balance_loss"],
               "z_loss": aux["z_loss"], "expert_load": aux["expert_load"],
               "dropped_fraction": aux["dropped_fraction"], **extra_metrics}
    if ROUTER_COUNTS in aux:             # auxiliary-loss-free balancing: the step's update
        metrics[ROUTER_COUNTS] = aux[ROUTER_COUNTS]
    if model.cfg.mtp.depth:
        mtp, mtp_metrics = mtp_loss(model, h, batch, mask)
        metrics.update(mtp_metrics, loss=total + mtp)
        total = total + mtp
        if ROUTER_COUNTS in metrics:     # the modules' routers follow the layers' rows
            metrics[ROUTER_COUNTS] = jnp.concatenate(
                [metrics[ROUTER_COUNTS], metrics.pop("mtp_" + ROUTER_COUNTS)])
    return total, metrics


def mtp_loss(model: Transformer, h: jax.Array, batch: Dict[str, jax.Array],
             mask: jax.Array) -> Tuple[jax.Array, dict]:
    """DeepSeek-V3's multi-token prediction objective (eq. 24-25) on the model's final-normed
    hidden states ``h``: lambda / D sum_k (CE_k + the depth's router losses at the routers'
    coefficients), CE_k each depth's mean cross-entropy of the tokens k + 1 ahead
    (:func:`dagmoe_jax.model.mtp.depth_targets`; the shared LM head applied a chunk at a
    time, as the main loss). Returns (the weighted term, its metrics: ``mtp_loss`` the mean
    CE_k)."""
    cfg, segments = model.cfg, batch.get("segment_ids")
    normed, aux = model.predict_further(h, batch["targets"], segments)
    ces = []
    for k in range(cfg.mtp.depth):
        targets, trained = depth_targets(batch["targets"], mask, segments, k + 1)
        ces.append(tiled_cross_entropy(normed[k], model.lm_head[...].astype(h.dtype), targets,
                                       trained, chunk_tokens=chunk_tokens(model.execution)))
    ce = jnp.mean(jnp.stack(ces))
    metrics = {"mtp_loss": ce}
    if ROUTER_COUNTS in aux:
        metrics["mtp_" + ROUTER_COUNTS] = aux[ROUTER_COUNTS]
    return cfg.mtp.loss_weight * (ce + aux["aux_loss"]), metrics


def _split_micro(batch: Dict[str, jax.Array], grad_accum: int) -> Dict[str, jax.Array]:
    """[B, ...] -> [grad_accum, B / grad_accum, ...] for every entry of ``batch``."""
    def split(x):
        if x.shape[0] % grad_accum:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into grad_accum="
                             f"{grad_accum} micro-batches: make DataConfig.batch_size a multiple")
        return x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:])
    return {k: split(v) for k, v in batch.items()}


def make_train_step(loss_fn: Callable = lm_loss, grad_accum: int = 1,
                    wrt=nnx.Param, donate: bool = False) -> Callable:
    """A jitted ``step(model, optimizer, batch) -> metrics`` updating both in place.

    ``donate``: the model's and optimizer's arrays are donated to the step, so XLA writes the
    new parameters and moments over the old ones instead of holding both (12 bytes a
    parameter: float32 weights and two AdamW moments). The old arrays are gone after the call, and
    with them any other model sharing them (``nnx.clone`` shares arrays), so it is off by
    default and on in the training loop, which owns its model. A checkpoint save is safe:
    Orbax copies the state to the host before ``save`` returns, and a buffer a host view still
    reads is not reused (tests/test_checkpoint.py checks a save's bytes after the next steps).

    ``wrt``: the parameters gradients are taken of (the optimizer's own ``wrt``; a
    :data:`TRAINABLE` filter), the others held fixed.

    Auxiliary-loss-free balancing (``RouterConfig.aux_free_bias_rate`` > 0): after the
    optimizer's update, every router's selection bias moves by the step's assignments per
    expert (:meth:`~dagmoe_jax.model.Transformer.update_selection_bias`; DeepSeek-V3 sec.
    2.1.2), counted over the whole batch (summed over micro-batches), when ``wrt`` trains the
    routers (:func:`routers_train`).

    With ``grad_accum`` > 1 the batch is cut into that many micro-batches whose gradients a
    ``lax.scan`` sums (one micro-batch's activations live at a time); the optimiser sees their
    mean, each micro-batch's cross-entropy summed over its tokens and divided by the whole
    batch's trained-token count over ``grad_accum`` (``mask``), so every token counts once, as
    in one big batch (Hugging Face's ``num_items_in_batch`` since transformers 4.46, which
    LlamaFactory runs); the metrics are micro-batch means of those terms. Across data-parallel shards the loss is already
    the global batch's token mean (the mask is summed over the global array).
    """

    @nnx.jit(donate_argnums=(0, 1) if donate else ())
    def step(model: Transformer, optimizer: nnx.Optimizer, batch):
        if grad_accum == 1:
            (_, metrics), grads = nnx.value_and_grad(
                loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)(model, batch)
            counts = metrics.pop(ROUTER_COUNTS, None)
        else:
            graphdef, params, rest = nnx.split(model, wrt, ...)

            def micro_step(summed, micro_batch):
                def loss_of(p):
                    # copies: ``rest`` (a selection bias) is of the trace outside the scan
                    return loss_fn(nnx.merge(graphdef, p, rest, copy=True), micro_batch)
                (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
                return jax.tree.map(jnp.add, summed, grads), metrics

            zeros = jax.tree.map(jnp.zeros_like, params)
            micro = _split_micro(batch, grad_accum)
            if "mask" in micro:    # each trained token counts once, whatever its micro-batch
                share = jnp.maximum(jnp.sum(micro["mask"].astype(jnp.float32)), 1.0) / grad_accum
                micro["ce_tokens"] = jnp.full((grad_accum,), share)
            grads, metrics = jax.lax.scan(micro_step, zeros, micro)
            grads = jax.tree.map(lambda g: g / grad_accum, grads)
            counts = metrics.pop(ROUTER_COUNTS, None)     # the whole batch's: summed
            counts = None if counts is None else jnp.sum(counts, axis=0)
            metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
        optimizer.update(model, grads)
        if counts is not None and routers_train(model, wrt):
            model.update_selection_bias(counts)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return replicated(metrics)

    return step
