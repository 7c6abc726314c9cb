"""The MoE family's config: router -> routed experts -> aggregation, plus shared experts
(docs/design.md sections 2-4). DAG-MoE is this family with ``aggregation.kind='dag'``."""

from __future__ import annotations

import dataclasses
from typing import Optional

from dagmoe_jax.config.families import register
from dagmoe_jax.config.blocks import ExpertConfig, RouterConfig, check_groups, check_nested
from dagmoe_jax.families.moe.budget import matched_shared_hidden
from dagmoe_jax.validate import check as _check, choice as _choice, positive as _positive

AGGREGATORS = ("sum", "dag", "mlp")
EDGE_ACTIVATIONS = ("silu", "sigmoid")
DAG_EDGES = ("all", "ranked", "self")
DAG_READINGS = ("once", "literal")


def edge_mask(k: int, edges: str):
    """[K, K] numpy booleans: the node pairs (receiver i, sender j) the graph of ``dag_edges``
    has: every pair ('all', eq. 9-11), those the router ranked at or above the receiver
    ('ranked'), or each node alone ('self')."""
    import numpy as np                 # only when asked: importing a config loads no numpy
    if edges == "ranked":
        return np.tril(np.ones((k, k), bool))
    return np.eye(k, dtype=bool) if edges == "self" else np.ones((k, k), bool)


@dataclasses.dataclass(frozen=True)
class AggregationConfig:
    """How the K expert outputs become the block output (docs/design.md section 4).

    kind: 'sum' (eq. 1), 'dag' (DAG-MoE eq. 6-12) or 'mlp' (the MLP-mixing ablation).
    dag_dim: hidden size d_g of the DAG module (and of the MLP mixer).
    dag_iters: DAG iterations L (depth of the learned DAG).
    edge_act: sigma of eq. 10: 'silu' (the paper: the experts' activation) or 'sigmoid'.
    dag_edges: 'all' (eq. 9-11: node i aggregates from all K nodes of the previous depth) or
      'ranked' (node i aggregates only from nodes the router ranked at or above it). With 'all'
      the update of node i depends on x_i and the *set* of nodes, so the module's output does
      not depend on the node order; 'ranked' makes the graph follow the router's ranking and
      the output order-sensitive (our extension, not in the paper). 'self': the edge-free
      ablation (ours): node i hears only itself, e_(i,i) * W_node [u_i; u_i], no message passing.
    dag_shared_weights: False (default): each iteration has its own weights, as eq. 8-11's
      superscript l writes them; True: one module applied in all L iterations, as the text's
      "each iteration applies the same module" (DAG-MoE sec. 3.3) reads.
    dag_residual: how the residual ``x / K`` of eq. 6 meets the decoder's own residual stream
      (x = RMSNorm(h) is the block input, the layer computes h + block output):
      'once' (default): x is counted once. The block returns sum_i x_i^L - x, the nodes'
        updates without the residual that eq. 12 sums back in, so the layer is
        h + sum_i (x_i^L - x / K); with W_up = 0 (its initialisation) this is exactly the MoE
        layer h + sum_k g_k E_k(x). The nodes themselves, and so every equation's inputs, are
        as written.
      'literal': the block returns eq. 12's sum_i x_i^L, so the layer is h + x + ...: every DAG
        layer adds a whole RMSNorm(h) (norm ~sqrt(d)) to the stream, which no other block
        does. Kept for comparison; it trains worse (docs/training.md, quality benchmark).
    """

    kind: str = "sum"
    dag_dim: int = 128
    dag_iters: int = 2
    edge_act: str = "silu"
    dag_edges: str = "all"
    dag_residual: str = "once"
    dag_shared_weights: bool = False

    def __post_init__(self):
        _choice("AggregationConfig", "kind", self.kind, AGGREGATORS)
        _positive("AggregationConfig", "dag_dim", self.dag_dim)
        _positive("AggregationConfig", "dag_iters", self.dag_iters)
        _choice("AggregationConfig", "edge_act", self.edge_act, EDGE_ACTIVATIONS)
        _choice("AggregationConfig", "dag_edges", self.dag_edges, DAG_EDGES)
        _choice("AggregationConfig", "dag_residual", self.dag_residual, DAG_READINGS)
        _check(isinstance(self.dag_shared_weights, bool), "AggregationConfig",
               "dag_shared_weights", self.dag_shared_weights, "True or False")

    def edge_mask(self, k: int):
        """[K, K] booleans: the node pairs the graph of ``dag_edges`` has among the K = top-k
        nodes (:func:`edge_mask`)."""
        return edge_mask(k, self.dag_edges)


@register(__package__, configurables=(AggregationConfig, matched_shared_hidden))
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The MoE block: router -> routed experts -> aggregation, plus shared experts
    (docs/design.md sections 2-4). DAG-MoE is ``aggregation.kind='dag'``.

    router, experts, aggregation: :class:`RouterConfig`, :class:`ExpertConfig`,
      :class:`AggregationConfig` (defaults: the DAG-MoE paper's small model with eq. 1's sum).
    """

    # The Hugging Face families a model of this block imports from and exports to (a class
    # attribute, not a field): the MoE ones (Mixtral, OLMoE, Qwen3-MoE; hf/moe.py picks).
    hf_family = "moe"
    kind: str = dataclasses.field(default="moe", init=False)
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    experts: ExpertConfig = dataclasses.field(default_factory=ExpertConfig)
    aggregation: AggregationConfig = dataclasses.field(default_factory=AggregationConfig)

    def __post_init__(self):
        check_nested(self)
        n = self.experts.num_experts
        _check(self.router.top_k <= n, "RouterConfig", "top_k", self.router.top_k,
               f"an integer in [1, num_experts={n}]")
        check_groups(self.router, n, self.router.top_k)

    @staticmethod
    def from_legacy(blob: dict) -> dict:
        """This block's fields in a model config saved while they sat at its top level
        (``ModelConfig.migrate``)."""
        return {"router": blob.get("router") or {}, "experts": blob.get("experts") or {},
                "aggregation": blob.get("aggregation") or {}}

    @property
    def label(self) -> str:
        """The family's name in progress lines: 'DAG-MoE' with the DAG module, else 'MoE'."""
        return "DAG-MoE" if self.aggregation.kind == "dag" else "MoE"

    def describe(self) -> str:
        """The block in a few words: 'DAG-MoE of 32 experts, top 4'."""
        return f"{self.label} of {self.experts.num_experts} experts, top {self.router.top_k}"
