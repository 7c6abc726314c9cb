"""Parameter and FLOP accounting for any :class:`ModelConfig`, by component: the backbone here,
the block from its family's ``accounting`` module (``layer_counts``, and ``model_counts`` for
what a family holds outside the layers).

Conventions (stated so the numbers can be checked by hand):

* A matmul of a token through a [m, n] weight costs 2 m n FLOPs forward; training costs 3x the
  forward FLOPs (backward = 2x forward). Embedding lookups and norms count as 0.
* Causal attention scores: QK^T and PV together cost 4 H hd c per token, with c the average
  visible context (S + 1) / 2.
* Routed experts count the K experts a token uses (C * K_t for CoE), not capacity padding.
* The DAG module projects every node once (its pair tensor is never built): per token and
  iteration K (4 d d_g + 8 d_g^2) matmul FLOPs (the CPU kernels' and 'xla' paths apply the
  last iteration's W_up once to the summed messages, K times fewer of its 2 K d_g d: an
  implementation's saving, not counted here), plus K^2 d_g pairwise elementwise work counted as
  4 FLOPs per element (two broadcast adds, one product, one sum; the activation not counted),
  reported separately as ``dag_pairwise`` (K d_g with ``dag_edges='self'``, the self pairs).
  ``dag_shared_weights`` counts the module's parameters once and its FLOPs L times.
* Active parameters per token count each distinct weight a token touches once.
* DoE: :mod:`dagmoe_jax.families.doe.accounting`.
* Multi-token prediction (``ModelConfig.mtp``) is one component, ``mtp``: its D modules'
  layers, projections and norms, and their use of the shared LM head, all of training (the
  modules are dropped at inference).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, NamedTuple, Tuple

from dagmoe_jax.config import ModelConfig, family_of

COMPONENTS = ("embedding", "attention", "attention_scores", "norms", "dense_ffn", "router",
              "experts", "shared_experts", "aggregator", "dag_pairwise", "doe_embedding",
              "doe_knowledge", "doe_router", "doe_ffn", "lm_head", "mtp")


class Counts(NamedTuple):
    """A family's counts by component (its ``accounting`` module's ``layer_counts``: one layer's
    parameters, active parameters and forward FLOPs per token; ``model_counts``: what it holds
    outside the layers, with training FLOPs)."""
    params: Dict[str, int]
    active: Dict[str, int]
    flops: Dict[str, float]


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


def routed_counts(cfg: ModelConfig, steps: int, k: int, routers: int, scales: int = 0) -> Counts:
    """One layer of a routed block (MoE, CoE): ``routers`` routers over N experts (plus
    ``scales`` learned scalars), ``steps`` routing steps of ``k`` experts each (a step's shared
    experts run once per step). The aggregator is the family's to add."""
    d, e = cfg.d_model, cfg.block.experts
    expert_p = 3 * d * e.expert_hidden
    shared_p = e.num_shared * 3 * d * e.shared_hidden
    params = {"router": routers * (d + int(cfg.block.router.bias)) * e.num_experts + scales,
              "experts": e.num_experts * expert_p, "shared_experts": shared_p}
    active = {**params, "experts": min(e.num_experts, steps * k) * expert_p}
    fwd = {"router": 2.0 * d * e.num_experts * routers, "experts": 2.0 * expert_p * steps * k,
           "shared_experts": 2.0 * shared_p * steps}
    return Counts(params, active, fwd)


def mla_params(cfg: ModelConfig) -> Tuple[int, int]:
    """(matrix parameters, norm scales) of one layer's multi-head latent attention
    (:mod:`dagmoe_jax.model.mla`): W_Q or W_DQ and W_UQ, W_DKV with W_KR, W_UKV, W_O; the
    latents' RMSNorm scales."""
    m, d, h = cfg.mla, cfg.d_model, cfg.num_heads
    queries = (d * m.q_lora_rank + m.q_lora_rank * h * m.qk_head_dim if m.q_lora_rank
               else d * h * m.qk_head_dim)
    keys_values = (d * (m.kv_lora_rank + m.qk_rope_head_dim)
                   + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim))
    return queries + keys_values + h * m.v_head_dim * d, m.q_lora_rank + m.kv_lora_rank


def account(cfg: ModelConfig, seq_len: int | None = None) -> Accounting:
    """Parameters (total and active per token) and training FLOPs per token by component."""
    s = seq_len or cfg.max_seq_len
    d, v, n_layers = cfg.d_model, cfg.vocab_size, cfg.num_layers
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    qk_norms = {"none": 0, "head": 2 * hd, "full": (h + kv) * hd}[cfg.qk_norm]
    per_layer: Dict[str, int] = {"attention": 2 * d * h * hd + 2 * d * kv * hd,
                                 "norms": 2 * d + qk_norms}
    # the scores' and values' products per token: 2 h (d_qk + d_v) (s + 1) / 2 (causal)
    scores = 2.0 * h * hd * (s + 1)
    if cfg.mla.enabled:
        per_layer["attention"], latent_norms = mla_params(cfg)
        per_layer["norms"] += latent_norms
        scores = 1.0 * h * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) * (s + 1)
    active: Dict[str, int] = dict(per_layer)
    fwd: Dict[str, float] = {"attention": 2.0 * per_layer["attention"],
                             "attention_scores": scores}
    family = family_of(cfg.block).part("accounting")
    params = {c: n_layers * p for c, p in per_layer.items()}
    active_params = {c: n_layers * p for c, p in active.items()}
    flops = {c: 3.0 * n_layers * f for c, f in fwd.items()}
    # the family's block in its routed_layers, the first_dense_layers' own SwiGLU in theirs
    stacks = [(family.layer_counts(cfg), cfg.routed_layers)]
    dense = cfg.first_dense_config()
    if dense is not None:
        stacks.append((family_of(dense.block).part("accounting").layer_counts(dense),
                       dense.num_layers))
    for block, layers in stacks:
        for totals, added, times in ((params, block.params, layers),
                                     (active_params, block.active, layers),
                                     (flops, block.flops, 3.0 * layers)):
            for c, n in added.items():
                totals[c] = totals.get(c, 0) + times * n
    if cfg.mtp.depth:     # DeepSeek-V3's modules: a layer of the family, M_k, three norms and
        block, depth = family.layer_counts(cfg), cfg.mtp.depth     # the shared head (training)
        own_p, own_f = 2 * d * d + 3 * d, 2.0 * 2 * d * d + 2.0 * d * v
        params["mtp"] = depth * (sum(per_layer.values()) + sum(block.params.values()) + own_p)
        active_params["mtp"] = depth * (sum(active.values()) + sum(block.active.values())
                                        + own_p)
        flops["mtp"] = 3.0 * depth * (sum(fwd.values()) + sum(block.flops.values()) + own_f)
    params["norms"] += d
    active_params["norms"] += d
    params["embedding"], active_params["embedding"] = v * d, d
    params["lm_head"] = active_params["lm_head"] = d * v
    flops["lm_head"] = 3.0 * 2.0 * d * v
    outside = getattr(family, "model_counts", None)     # the family's weights outside the layers
    if outside is not None:
        extra = outside(cfg)
        for totals, added in ((params, extra.params), (active_params, extra.active),
                              (flops, extra.flops)):
            for c, n in added.items():
                totals[c] = totals.get(c, 0) + n
    return Accounting(params, active_params, flops, s)
