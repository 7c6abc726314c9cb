"""Parameter and FLOP accounting for any :class:`ModelConfig`, by component.

Conventions (stated so the numbers can be checked by hand):

* A matmul of a token through a [m, n] weight costs 2 m n FLOPs forward; training costs 3x the
  forward FLOPs (backward = 2x forward). Embedding lookups and norms count as 0.
* Causal attention scores: QK^T and PV together cost 4 H hd c per token, with c the average
  visible context (S + 1) / 2.
* Routed experts count the K experts a token uses (C * K_t for CoE), not capacity padding.
* The DAG module projects every node once (its pair tensor is never built): per token and
  iteration K (4 d d_g + 8 d_g^2) matmul FLOPs (the CPU kernels' path applies the last
  iteration's W_up once to the summed messages, K times fewer of its 2 K d_g d: an
  implementation's saving, not counted here), plus K^2 d_g pairwise elementwise work counted as
  4 FLOPs per element (two broadcast adds, one product, one sum; the activation not counted),
  reported separately as ``dag_pairwise`` (K d_g with ``dag_edges='self'``, the self pairs).
  ``dag_shared_weights`` counts the module's parameters once and its FLOPs L times.
* Active parameters per token count each distinct weight a token touches once.
* DoE (docs/design.md section 6). ``doe_knowledge``: W_Q and Z per layer (eq. 1-3: 2 d^2 +
  4 K d FLOPs; Z once with ``shared_knowledge``) and, composed, G^T Z (2 K d);
  ``doe_router``: the VAE bank (counted once per entry, however many layers share it) and
  each layer's gate W_g, b; ``doe_embedding``: E_know, W_in and the first layer's topic weight
  (with ``first_input='theta'`` also the mixture theta^T E_know, 2 (K + 1) d_k FLOPs).
  ``doe_ffn``: with expert='composed' FFN([H_enr ; e_context]) (input 2d: 5 d hidden
  weights), all active (the gates compose all K knowledge blocks); with expert='blocks' the K
  FFN slices (3 d h_b each), of which a token runs at most N = top_n (or K): active and FLOPs
  count N slices, an upper bound (ReLU's zero gates skip more, ``gate_active_fraction``).
  The VAE decoder runs only with a reconstruction loss (``recon_coef > 0``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from dagmoe_jax.config import ModelConfig, aggregation_of, dag_params_per_layer
from dagmoe_jax.model.doe.block import shared_param_counts
from dagmoe_jax.model.doe.knowledge_blocks import active_blocks, block_hidden

COMPONENTS = ("embedding", "attention", "attention_scores", "norms", "dense_ffn", "router",
              "experts", "shared_experts", "aggregator", "dag_pairwise", "doe_embedding",
              "doe_knowledge", "doe_router", "doe_ffn", "lm_head")


@dataclasses.dataclass(frozen=True)
class Accounting:
    params: Dict[str, int]          # total parameters by component
    active_params: Dict[str, int]   # parameters a single token uses, by component
    flops: Dict[str, float]         # training FLOPs per token, by component
    seq_len: int

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    @property
    def total_active_params(self) -> int:
        return sum(self.active_params.values())

    @property
    def train_flops_per_token(self) -> float:
        return sum(self.flops.values())

    def table(self) -> str:
        """A plain-text table of the three columns by component."""
        rows = [f"{'component':<18}{'params':>14}{'active':>14}{'train MFLOP/tok':>17}"]
        for c in COMPONENTS:
            p, a, f = self.params.get(c, 0), self.active_params.get(c, 0), self.flops.get(c, 0.0)
            if p or a or f:
                rows.append(f"{c:<18}{p:>14,}{a:>14,}{f / 1e6:>17.3f}")
        rows.append(f"{'total':<18}{self.total_params:>14,}{self.total_active_params:>14,}"
                    f"{self.train_flops_per_token / 1e6:>17.3f}")
        return "\n".join(rows)


def aggregator_params(cfg: ModelConfig) -> int:
    """Parameters of one layer's aggregator: the DAG module or the MLP mixer (0 for 'sum')."""
    a = aggregation_of(cfg.block)
    if a is None or a.kind == "sum":
        return 0
    if a.kind == "dag":
        return dag_params_per_layer(cfg.d_model, a.dag_dim, a.dag_iters, a.dag_shared_weights)
    return 3 * cfg.d_model * a.dag_dim


def aggregator_forward_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(matmul, pairwise) forward FLOPs per token of one layer's aggregator."""
    a = aggregation_of(cfg.block)
    if a is None or a.kind == "sum":
        return 0.0, 0.0
    d, k = cfg.d_model, cfg.block.router.top_k
    if a.kind == "dag":
        dg, pairs = a.dag_dim, k if a.dag_edges == "self" else k * k   # 'self': K pairs
        return (a.dag_iters * k * (4 * d * dg + 8 * dg * dg),
                a.dag_iters * 4 * pairs * dg)
    return 6.0 * d * a.dag_dim, 0.0


def account(cfg: ModelConfig, seq_len: int | None = None) -> Accounting:
    """Parameters (total and active per token) and training FLOPs per token by component."""
    s = seq_len or cfg.max_seq_len
    d, v, n_layers = cfg.d_model, cfg.vocab_size, cfg.num_layers
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    qk_norms = {"none": 0, "head": 2 * hd, "full": (h + kv) * hd}[cfg.qk_norm]
    per_layer: Dict[str, int] = {"attention": 2 * d * h * hd + 2 * d * kv * hd,
                                 "norms": 2 * d + qk_norms}
    active: Dict[str, int] = dict(per_layer)
    fwd: Dict[str, float] = {"attention": 2.0 * per_layer["attention"],
                             "attention_scores": 2.0 * h * hd * (s + 1)}
    if cfg.block.kind == "dense":
        per_layer["dense_ffn"] = active["dense_ffn"] = 3 * d * cfg.resolved_ffn_hidden
        fwd["dense_ffn"] = 2.0 * per_layer["dense_ffn"]
    elif cfg.block.kind == "doe":
        c = cfg.block
        k, hid = c.num_topics, cfg.resolved_ffn_hidden
        per_layer["doe_knowledge"] = active["doe_knowledge"] = (
            d * d + (0 if c.shared_knowledge else k * d))
        per_layer["doe_router"] = active["doe_router"] = c.latent_dim * k + k
        composed = c.expert == "composed"
        if composed:
            per_layer["doe_ffn"] = active["doe_ffn"] = 5 * d * hid
        else:
            per_layer["doe_ffn"] = k * 3 * d * block_hidden(cfg)
            active["doe_ffn"] = active_blocks(cfg) * 3 * d * block_hidden(cfg)
        sig = (h if c.signal == "q" else kv) * hd
        vae_fwd = 2.0 * (d * c.vae_hidden + sig * c.vae_hidden + 2 * c.vae_hidden * c.latent_dim)
        if c.recon_coef > 0:
            vae_fwd += 2.0 * c.latent_dim * d
        fwd.update(doe_knowledge=2.0 * d * d + (6.0 if composed else 4.0) * k * d,
                   doe_router=vae_fwd + 2.0 * c.latent_dim * k,
                   doe_ffn=2.0 * active["doe_ffn"])
    else:
        e = cfg.block.experts
        expert_p = 3 * d * e.expert_hidden
        shared_p = e.num_shared * 3 * d * e.shared_hidden
        if cfg.block.kind == "coe":
            steps, k = cfg.block.iterations, cfg.block.resolved_top_k
            routers = 1 if cfg.block.shared_router else steps   # a shared router runs once
        else:
            steps, k, routers = 1, cfg.block.router.top_k, 1
        scales = (steps - 1 if cfg.block.kind == "coe" and cfg.block.iteration_scales else 0)
        per_layer["router"] = active["router"] = (routers * (d + int(cfg.block.router.bias))
                                                  * e.num_experts + scales)   # + CoE's a_t
        per_layer["experts"] = e.num_experts * expert_p
        active["experts"] = min(e.num_experts, steps * k) * expert_p
        per_layer["shared_experts"] = active["shared_experts"] = shared_p
        per_layer["aggregator"] = active["aggregator"] = aggregator_params(cfg)
        agg_mm, agg_pair = aggregator_forward_flops(cfg)
        fwd.update(router=2.0 * d * e.num_experts * routers,
                   experts=2.0 * expert_p * steps * k,
                   shared_experts=2.0 * shared_p * steps,
                   aggregator=agg_mm, dag_pairwise=agg_pair)
    params = {c: n_layers * p for c, p in per_layer.items()}
    active_params = {c: n_layers * p for c, p in active.items()}
    params["norms"] += d
    active_params["norms"] += d
    params["embedding"], active_params["embedding"] = v * d, d
    params["lm_head"] = active_params["lm_head"] = d * v
    flops = {c: 3.0 * n_layers * f for c, f in fwd.items()}
    flops["lm_head"] = 3.0 * 2.0 * d * v
    if cfg.block.kind == "doe":
        bank, embedding = shared_param_counts(cfg)
        params["doe_router"] += bank
        active_params["doe_router"] += bank
        params["doe_embedding"] = active_params["doe_embedding"] = embedding
        if cfg.block.shared_knowledge:                  # one Z for every layer
            params["doe_knowledge"] += cfg.block.num_topics * d
            active_params["doe_knowledge"] += cfg.block.num_topics * d
        c = cfg.block
        mixture = (c.num_topics + 1) * c.topic_dim if c.first_input == "theta" else 0
        flops["doe_embedding"] = 3.0 * 2.0 * ((d + c.topic_dim) * d + c.topic_dim * c.vae_hidden
                                              + mixture)
    return Accounting(params, active_params, flops, s)
