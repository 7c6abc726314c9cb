"""DoE's training objective (DoE eq. 4 and 7) and the model inputs of a batch.

total = (1 - alpha) L_ntp + alpha L_expert (+ the VAE's KL and reconstruction terms), where
L_expert is the cross-entropy of every layer's router logits against the tokens' LDA expert
labels. The training step reaches it through
:class:`~dagmoe_jax.families.doe.extension.DoEExtension`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from dagmoe_jax.config import ModelConfig


def expert_loss(logits: jax.Array, labels: jax.Array, null_id: int) -> jax.Array:
    """DoE eq. 9, our reading: ``L_expert = CE(softmax(r), y_expert)`` with r the router's
    pre-ReLU logits [..., K], averaged over tokens whose label is in [0, K) (``null_id`` = K and
    the padding's -1 are masked; 0 if none is left).

    The paper writes CE(G, y); with G = ReLU(r), G / sum G is undefined where the label's gate
    is 0 and ReLU passes no gradient that could raise it, so the logits stand in for G (for a
    one-hot y this CE equals the paper's D_KL(y || G)).
    """
    valid = (labels >= 0) & (labels != null_id)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.where(valid, labels, 0))
    w = valid.astype(jnp.float32)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def composite_loss(ntp: jax.Array, expert: jax.Array, alpha: float) -> jax.Array:
    """DoE eq. 4: ``L_total = (1 - alpha) L_ntp + alpha L_expert``."""
    return (1.0 - alpha) * ntp + alpha * expert




def noise_key(inputs: jax.Array, seed: int = 0) -> jax.Array:
    """The key of the VAE's training noise (eq. 6) for a batch: folded from the batch's tokens.

    Stateless (no RNG in the model or the training state), so a resumed run draws exactly the
    noise the uninterrupted run drew, and every batch draws its own.
    """
    weights = (jnp.arange(inputs.size, dtype=jnp.uint32) * jnp.uint32(2654435761)
               + jnp.uint32(1)).reshape(inputs.shape)
    digest = jnp.sum(inputs.astype(jnp.uint32) * weights, dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.key(seed), digest)


def model_inputs(cfg: ModelConfig, batch: dict, *, train: bool) -> dict:
    """Keyword inputs of ``Transformer.__call__`` for ``batch``: ``topics`` for a DoE model
    (and the training ``noise`` key when ``train``), nothing for other blocks."""
    if cfg.block.kind != "doe":
        return {}
    extra = {"features": {"topics": batch.get("topics")}}
    if train:
        extra["noise"] = noise_key(batch["inputs"])
    return extra


def doe_objective(cfg: ModelConfig, ntp: jax.Array, aux: dict, batch: dict):
    """The DoE training loss and its logged terms: (total, metrics).

    total = (1 - alpha) L_ntp + alpha L_expert (eq. 4) + kl_coef KL + recon_coef recon (eq. 7,
    optional) + the auxiliary router losses every block reports (zero for DoE). L_expert is the
    mean over layers of :func:`expert_loss` against ``batch['topic_labels']``.
    """
    c, doe = cfg.block, aux["extra"]
    kl, recon = jnp.mean(doe.kl), jnp.mean(doe.recon)
    if c.use_topics and "topic_labels" in batch:
        labels = batch["topic_labels"]
        expert = jnp.mean(jax.vmap(lambda r: expert_loss(r, labels, c.num_topics))(
            doe.router_logits))
    else:
        expert = jnp.zeros((), jnp.float32)
    total = composite_loss(ntp, expert, c.alpha) + c.kl_coef * kl + c.recon_coef * recon
    total = total + aux["aux_loss"]
    metrics = {"expert_loss": expert, "kl_loss": kl, "recon_loss": recon,
               "gate_active_fraction": jnp.mean(doe.active_fraction),
               "vae_log_sigma": jnp.mean(doe.log_sigma)}
    return total, metrics
