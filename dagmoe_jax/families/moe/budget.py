"""Parameter budgets: what the DAG module adds to a layer, and the modules matched to it.

Plain integer arithmetic (no model code), registered with the MoE and CoE families' configs and
so bound in gin (``@matched_shared_hidden()``, ``@matched_coe_shared_hidden()``); the MoE
family's accounting counts the DAG module with it. docs/design.md section 4 ("Parameter
parity") and section 5 ("Equal-parameter preset").
"""

from __future__ import annotations


def dag_params_per_layer(d_model: int, dag_dim: int, dag_iters: int,
                         shared: bool = False) -> int:
    """Parameters the DAG module adds to one layer: L * (2 d d_g + 4 d_g^2 + 2 d).

    W_down [d, d_g] and W_up [d_g, d] give 2 d d_g, W_edge and W_node [2 d_g, d_g] give 4 d_g^2,
    and the LayerNorm of eq. 7 has a scale and a bias of d each. ``shared``
    (``AggregationConfig.dag_shared_weights``): one set applied in all L iterations, counted once.
    """
    return (1 if shared else dag_iters) * (2 * d_model * dag_dim + 4 * dag_dim * dag_dim
                                           + 2 * d_model)


def matched_shared_hidden(d_model: int, dag_dim: int, dag_iters: int, multiple: int = 8) -> int:
    """The shared-expert hidden size d_r whose 3 d d_r parameters match the DAG module's.

    The nearest multiple of ``multiple`` (hardware-friendly shapes) to the exact match. This is
    the paper's parity baseline (DAG-MoE sec. 5.1): d 512, d_g 128, L 2 adds 395,264 parameters,
    matched by a shared expert of d_r 256 (393,216); d 1024, d_g 256, L 2 gives 512 (Appendix B.2).
    """
    exact = dag_params_per_layer(d_model, dag_dim, dag_iters) / (3 * d_model)
    return max(multiple, int(round(exact / multiple)) * multiple)


def coe_extra_router_params(d_model: int, num_experts: int, iterations: int,
                            router_bias: bool = False) -> int:
    """What CoE's routers add over MoE's one: (C - 1) (d + bias) N (one router per iteration)."""
    return (iterations - 1) * (d_model + int(router_bias)) * num_experts


def matched_coe_shared_hidden(d_model: int, dag_dim: int, dag_iters: int, num_experts: int,
                              iterations: int = 2, router_bias: bool = False,
                              multiple: int = 1) -> int:
    """The shared-expert d_r that makes a CoE layer (its extra routers + one shared expert of
    3 d d_r) add the DAG module's parameters: the nearest multiple of ``multiple`` to
    (dag_params_per_layer - extra routers) / (3 d). The residual is at most 1.5 d ``multiple``;
    :func:`coe_budget_residual` gives it. d 512, d_g 128, L 2, N 32: d_r 247, +512 (0.13%)."""
    rest = (dag_params_per_layer(d_model, dag_dim, dag_iters)
            - coe_extra_router_params(d_model, num_experts, iterations, router_bias))
    return max(multiple, int(round(rest / (3 * d_model) / multiple)) * multiple)


def coe_budget_residual(d_model: int, dag_dim: int, dag_iters: int, num_experts: int,
                        shared_hidden: int, iterations: int = 2,
                        router_bias: bool = False) -> int:
    """CoE's added parameters per layer minus the DAG module's (0 = an exact match)."""
    added = (coe_extra_router_params(d_model, num_experts, iterations, router_bias)
             + 3 * d_model * shared_hidden)
    return added - dag_params_per_layer(d_model, dag_dim, dag_iters)
