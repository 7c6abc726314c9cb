"""The DoE block's parameters and FLOPs (docs/design.md section 6; the conventions of
:mod:`dagmoe_jax.model.accounting`).

``doe_knowledge``: W_Q and Z per layer (eq. 1-3: 2 d^2 + 4 K d FLOPs; Z once with
``shared_knowledge``) and, composed, G^T Z (2 K d); ``doe_router``: the VAE bank (counted once
per entry, however many layers share it) and each layer's gate W_g, b; ``doe_embedding``:
E_know, W_in and the first layer's topic weight (with ``first_input='theta'`` also the mixture
theta^T E_know, 2 (K + 1) d_k FLOPs). ``doe_ffn``: with expert='composed' FFN([H_enr ;
e_context]) (input 2d: 5 d hidden weights), all active (the gates compose all K knowledge
blocks); with expert='blocks' the K FFN slices (3 d h_b each), of which a token runs at most
N = top_n (or K): active and FLOPs count N slices, an upper bound (ReLU's zero gates skip
more, ``gate_active_fraction``). The VAE decoder runs only with a reconstruction loss
(``recon_coef > 0``).
"""

from __future__ import annotations

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.families.doe.block import shared_param_counts
from dagmoe_jax.families.doe.knowledge_blocks import active_blocks, block_hidden
from dagmoe_jax.model.accounting import Counts


def layer_counts(cfg: ModelConfig) -> Counts:
    """One layer: W_Q and Z, the gate, and the FFN (composed, or the knowledge blocks)."""
    c, d = cfg.block, cfg.d_model
    k, hid = c.num_topics, cfg.resolved_ffn_hidden
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    params = {"doe_knowledge": d * d + (0 if c.shared_knowledge else k * d),
              "doe_router": c.latent_dim * k + k}
    active = dict(params)
    composed = c.expert == "composed"
    if composed:
        params["doe_ffn"] = active["doe_ffn"] = 5 * d * hid
    else:
        params["doe_ffn"] = k * 3 * d * block_hidden(cfg)
        active["doe_ffn"] = active_blocks(cfg) * 3 * d * block_hidden(cfg)
    sig = (h if c.signal == "q" else kv) * hd
    vae = 2.0 * (d * c.vae_hidden + sig * c.vae_hidden + 2 * c.vae_hidden * c.latent_dim)
    if c.recon_coef > 0:
        vae += 2.0 * c.latent_dim * d
    flops = {"doe_knowledge": 2.0 * d * d + (6.0 if composed else 4.0) * k * d,
             "doe_router": vae + 2.0 * c.latent_dim * k, "doe_ffn": 2.0 * active["doe_ffn"]}
    return Counts(params, active, flops)


def model_counts(cfg: ModelConfig) -> Counts:
    """Outside the layers (:class:`~dagmoe_jax.families.doe.block.DoEShared`): the VAE bank,
    the topic embedding with W_in and W_t, and Z when every layer shares it; training FLOPs."""
    c, d = cfg.block, cfg.d_model
    bank, embedding = shared_param_counts(cfg)
    params = {"doe_router": bank, "doe_embedding": embedding,
              "doe_knowledge": c.num_topics * d if c.shared_knowledge else 0}
    mixture = (c.num_topics + 1) * c.topic_dim if c.first_input == "theta" else 0
    flops = {"doe_embedding": 3.0 * 2.0 * ((d + c.topic_dim) * d + c.topic_dim * c.vae_hidden
                                           + mixture)}
    return Counts(params, dict(params), flops)


def grouped_matmul_width(cfg: ModelConfig) -> int:
    """The hidden width of the grouped matmuls the block runs: one knowledge block's h_b in
    the 'blocks' reading; the composed reading runs none, so d_model (never used)."""
    return block_hidden(cfg) if cfg.block.expert == "blocks" else cfg.d_model
