"""A trained MoE turned into a DAG-MoE or a Chain-of-Experts model that computes the same
outputs, for fine-tuning a pre-trained checkpoint into the seeds' architectures
(docs/design.md section 7).

* **DAG-MoE** (DAG-MoE eq. 6-12): the experts' outputs are aggregated by the DAG module instead
  of summed. The module's new parameters are initialised as in any model, W_up = 0, so the
  module adds nothing and the converted model computes the MoE's outputs exactly.
* **Chain-of-Experts** (CoE eq. 4-7, the inner residual): C iterations over the MoE's own
  experts. The first routes as the MoE did (its router, score function, renormalisation and
  top-K); every later one starts with a copy of that router and its update scaled by
  a_t = 0 (``CoEConfig.iteration_scales``), so the layer is h + MoE(x) until training moves
  a_t off zero. Only the inner residual with ``stream='once'`` has that property: 'outer' and
  'init' replace x^(1) by the zero-scaled later update, and the other streams add x = RMSNorm(h)
  to the layer, so those are refused.

:func:`converted_config` gives the converted ``ModelConfig`` (the source's, with the target
block's conversion fields), :func:`converted_params` the converted model's parameters from the
source's; the parameters it does not give (the DAG module) keep their initialisation.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Tuple

import numpy as np

from dagmoe_jax.config import ModelConfig, block_summary
from dagmoe_jax.families.coe.config import CoEConfig

Path = Tuple  # a parameter's attribute path, e.g. ('layers', 'block', 'router', 'w_router')
_ROUTER = ("layers", "block", "router")


def is_conversion(source: ModelConfig, target_block) -> bool:
    """Whether a model of block ``target_block`` is a conversion of ``source``: an MoE whose
    experts are summed, asked to become a DAG-MoE (``MoEConfig`` with another aggregation)
    or a CoE."""
    if source.block.kind != "moe" or source.block.aggregation.kind != "sum":
        return False
    return target_block.kind == "coe" or (
        target_block.kind == "moe" and target_block.aggregation.kind != "sum")


def converted_config(source: ModelConfig, block) -> ModelConfig:
    """``source`` (an MoE summing its experts) with the block ``block`` asks for: a DAG-MoE
    (``MoEConfig`` with ``aggregation.kind='dag'``, the aggregation taken from it) or a CoE
    (its ``iterations`` and ``shared_router``; router, experts and K from ``source``). Any
    other request, and a CoE setting under which the chain cannot equal the MoE, is a
    one-line ValueError naming the field."""
    if not is_conversion(source, block):
        raise ValueError(f"only an MoE summing its experts converts to DAG-MoE or CoE, not "
                         f"{block_summary(source.block)} to block={block.kind!r}")
    if block.kind == "moe":
        if block.aggregation.kind != "dag":
            raise ValueError(f"AggregationConfig.kind={block.aggregation.kind!r}: an MoE "
                             f"converts to 'dag' (whose zero W_up keeps its outputs), not to "
                             f"another aggregation")
        return dataclasses.replace(source, block=dataclasses.replace(
            source.block, aggregation=block.aggregation))
    moe, k = source.block, source.block.router.top_k
    for field, value, allowed, why in (
            ("residual", block.residual, "inner", "with 'outer' or 'init' the zero-scaled "
             "later iterations replace the MoE's update"),
            ("stream", block.stream, "once", "'literal' and 'reference' add RMSNorm(h) to the "
             "layer, which the MoE does not"),
            ("top_k_per_iter", block.top_k_per_iter, k, f"the first iteration selects the "
             f"MoE's K={k} experts (None takes it)"),
            ("score_fn", block.score_fn, moe.router.score_fn, "the iterations score as the "
             "MoE's router (None takes it)")):
        if value is not None and value != allowed:
            raise ValueError(f"CoEConfig.{field}={value!r} cannot convert an MoE at its "
                             f"outputs: {why} (CoEConfig.{field}={allowed!r} can)")
    return dataclasses.replace(source, block=CoEConfig(
        iterations=block.iterations, top_k_per_iter=k, shared_router=block.shared_router,
        residual="inner", stream="once", score_fn=None, iteration_scales=True,
        router=moe.router, experts=moe.experts))


def coe_request(source: ModelConfig, iterations: int, shared_router: bool = False) -> CoEConfig:
    """The CoE block of ``iterations`` that converting the MoE ``source`` asks for (its
    router, experts and K), for :func:`converted_config`."""
    moe = source.block
    if moe.kind != "moe":
        raise ValueError(f"only an MoE converts to CoE, not block={moe.kind!r}")
    return CoEConfig(iterations=iterations, top_k_per_iter=moe.router.top_k,
                     shared_router=shared_router, router=moe.router, experts=moe.experts)


def converted_params(params: Iterable[Tuple[Path, np.ndarray]], source: ModelConfig,
                     target: ModelConfig) -> Iterator[Tuple[Path, np.ndarray]]:
    """The parameters (path, array) of ``target`` (:func:`converted_config` of ``source``)
    from ``source``'s, read one at a time: a DAG-MoE's are the MoE's (the DAG module is not
    among them); a CoE's router is the MoE's router copied to every iteration's (its selection
    bias too), with the later iterations' scales a_t = 0."""
    if target.block.kind != "coe":
        yield from params
        return
    routers = 1 if target.block.shared_router else target.block.iterations
    stacks = {("layers",): source.routed_layers, ("mtp", "layer"): source.mtp.depth}
    for path, value in params:
        stack = next((s for s in stacks if tuple(path[:len(s) + 2]) == s + _ROUTER[1:]), None)
        if stack is not None:
            rest = tuple(path[len(stack) + 2:])
            for r in range(routers):    # a copy each: the routers must not share a buffer
                yield (stack + ("block", "routers", r) + rest,
                       value if r == 0 else np.array(value, copy=True))
        else:
            yield path, value
    if target.block.iterations > 1:     # the layers' and the multi-token prediction modules'
        for stack, layers in stacks.items():
            if layers:
                yield (stack + ("block", "iteration_scales"),
                       np.zeros((layers, target.block.iterations - 1), np.float32))
