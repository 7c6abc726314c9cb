"""The benchmark variants, built from one base model at equal parameters.

Every benchmark here compares the same designs on one trunk (the base ``ModelConfig``):

=============  ==============================================================================
``moe``        weighted sum of the top-K experts (DAG-MoE eq. 1), no shared expert: the
               paper's "MoE without shared expert" reference (fewer parameters than the rest)
``moe_shared`` MoE + one shared expert whose 3 d d_r parameters match the DAG module's
``dag_l1``     DAG-MoE (eq. 6-12), L = 1, d_g chosen so the module has the budget's parameters
``dag_l2``     DAG-MoE, L = 2, d_g = ``dag_dim`` (this defines the budget, as in the paper's
               "393K" parity: d 512, d_g 128, L 2)
``dag_l3``     DAG-MoE, L = 3, d_g chosen to match the budget
``mlp``        the MLP-mixing ablation, d_g chosen so its 3 d d_g parameters match the budget
``mlp_small``  the MLP-mixing ablation at its own size in the DAG-MoE summary: d_g = dag_dim / 2
               (the summary's 98K, d_g 64, beside a 393K DAG of d_g 128), a quarter-ish of the
               budget; the paper's MLP-mixing number belongs to this one
``coe``        Chain-of-Experts: 2 iterations of K / 2 experts (the same K expert calls per
               token as the others), one router per iteration, plus a shared expert whose
               d_r makes router + expert the budget (our reading of the summary's "CoE, 393K,
               equal params")
``dag_self``   the edge-free ablation (ours): DAG-MoE L 2 at d_g = ``dag_dim`` with
               ``dag_edges='self'``, each node updated from itself only (no message passing):
               the same parameters as ``dag_l2`` exactly, so structure and interaction separate
=============  ==============================================================================

"Equal parameters" therefore means (``mlp_small`` aside): the parameters each variant adds to ``moe`` per layer are
the DAG-MoE L 2 module's ``L (2 d d_g + 4 d_g^2 + 2 d)``, to the nearest integer hidden size
(within a fraction of a percent; the benchmarks print the exact counts from
:func:`dagmoe_jax.model.accounting.account`). CoE's second router (d N per layer) counts in its
budget: the shared expert is d_r = (budget - d N) / (3 d) rounded
(:func:`dagmoe_jax.families.moe.budget.matched_coe_shared_hidden`), exact when 3 d divides it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from dagmoe_jax.families.moe.budget import matched_coe_shared_hidden
from dagmoe_jax.config import ModelConfig, aggregation_of
from dagmoe_jax.families.coe.config import CoEConfig
from dagmoe_jax.families.moe.config import MoEConfig
from dagmoe_jax.families.moe.budget import dag_params_per_layer

VARIANTS: Tuple[str, ...] = ("moe", "moe_shared", "dag_l1", "dag_l2", "dag_l3", "mlp",
                             "mlp_small", "coe", "dag_self")

LABELS: Dict[str, str] = {
    "moe": "MoE",
    "moe_shared": "MoE + shared expert",
    "dag_l1": "DAG-MoE L 1",
    "dag_l2": "DAG-MoE L 2",
    "dag_l3": "DAG-MoE L 3",
    "mlp": "MLP mixing",
    "mlp_small": "MLP mixing, d_g/2",
    "coe": "CoE (2 iterations)",
    "dag_self": "DAG L 2, no edges",
}

# Every variant other than 'moe' adds the same parameters per layer; 'moe' is the reference.
REFERENCE = "moe"


def budget_params(d_model: int, dag_dim: int) -> int:
    """Parameters per layer every non-reference variant adds: a DAG module of d_g, L 2."""
    return dag_params_per_layer(d_model, dag_dim, 2)


def matched_dag_dim(d_model: int, budget: int, dag_iters: int) -> int:
    """The d_g >= 1 whose DAG module of ``dag_iters`` iterations is closest to ``budget``."""
    best, best_gap = 1, None
    for dg in range(1, 4 * d_model + 1):
        gap = abs(dag_params_per_layer(d_model, dg, dag_iters) - budget)
        if best_gap is None or gap < best_gap:
            best, best_gap = dg, gap
        if dag_params_per_layer(d_model, dg, dag_iters) > budget:
            break
    return best


def matched_hidden(d_model: int, budget: int) -> int:
    """The hidden size h >= 1 of a 3 d h block (SwiGLU expert, MLP mixer) closest to ``budget``."""
    return max(1, round(budget / (3 * d_model)))


def variant_config(base: ModelConfig, name: str, dag_dim: int) -> ModelConfig:
    """``base`` turned into variant ``name`` (see the module docstring) with budget ``dag_dim``.

    ``base`` supplies the trunk, the experts and the router (top-K); its aggregation, shared
    experts and block type are replaced. An unknown name is a one-line ``ValueError``.
    """
    if name not in VARIANTS:
        raise ValueError(f"variant {name!r} is invalid: expected one of {', '.join(VARIANTS)}")
    d, k = base.d_model, base.block.router.top_k
    budget = budget_params(d, dag_dim)
    plain = base.replace(block=MoEConfig(router=base.block.router, experts=dataclasses.replace(
        base.block.experts, num_shared=0)))
    if name == "moe":
        return plain
    if name == "moe_shared":
        return plain.replace(block=dict(experts=dict(num_shared=1,
                                                      shared_hidden=matched_hidden(d, budget))))
    if name == "dag_self":
        return plain.replace(block=dict(aggregation=dict(kind="dag", dag_iters=2, dag_dim=dag_dim,
                                                         dag_edges="self")))
    if name.startswith("dag_l"):
        iters = int(name[len("dag_l"):])
        return plain.replace(block=dict(aggregation=dict(
            kind="dag", dag_iters=iters, dag_dim=matched_dag_dim(d, budget, iters))))
    if name == "mlp":
        return plain.replace(block=dict(aggregation=dict(kind="mlp",
                                                         dag_dim=matched_hidden(d, budget))))
    if name == "mlp_small":
        return plain.replace(block=dict(aggregation=dict(kind="mlp", dag_dim=max(1, dag_dim // 2))))
    if k < 2:
        raise ValueError(f"variant 'coe' needs RouterConfig.top_k >= 2 (it is {k}): two CoE "
                         "iterations of top_k // 2 experts each")
    hidden = matched_coe_shared_hidden(d, dag_dim, 2, base.block.experts.num_experts, 2,
                                       base.block.router.bias)
    return plain.replace(block=CoEConfig(
        iterations=2, top_k_per_iter=k // 2, shared_router=False, residual="inner",
        router=plain.block.router,
        experts=dataclasses.replace(plain.block.experts, num_shared=1, shared_hidden=hidden)))


def describe(cfg: ModelConfig) -> str:
    """A short description of a variant's block: 'dag d_g 50 L 1', 'sum + shared 87', ..."""
    block = cfg.block
    if aggregation_of(block) is None:                  # the chain: it sums each iteration
        text = f"coe {block.iterations} x {block.resolved_top_k}"
    elif block.aggregation.kind == "dag":
        a = block.aggregation
        text = f"dag d_g {a.dag_dim} L {a.dag_iters}"
        text += "" if a.dag_edges == "all" else f" {a.dag_edges}"
        text += " shared" if a.dag_shared_weights else ""
    elif block.aggregation.kind == "mlp":
        text = f"mlp d_g {block.aggregation.dag_dim}"
    else:
        text = f"sum top-{block.router.top_k}"
    if block.experts.num_shared:
        text += f" + shared d_r {block.experts.shared_hidden}"
    return text
