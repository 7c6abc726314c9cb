"""The Chain-of-Experts family's config (docs/design.md section 5; CoE eq. 4-10)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from dagmoe_jax.config.families import register
from dagmoe_jax.config.blocks import (SCORE_FNS, ExpertConfig, RouterConfig, check_groups,
                                      check_nested)
from dagmoe_jax.families.moe.budget import matched_coe_shared_hidden
from dagmoe_jax.validate import choice as _choice, check as _check, positive as _positive

COE_RESIDUALS = ("inner", "outer", "init")
COE_READINGS = ("once", "literal", "reference")


@register(__package__, configurables=(matched_coe_shared_hidden,))
@dataclasses.dataclass(frozen=True)
class CoEConfig:
    """Chain-of-Experts block (docs/design.md section 5; CoE eq. 4-10).

    iterations: communication steps C.
    top_k_per_iter: experts per iteration K_t; None means router.top_k // iterations.
    shared_router: reuse the first iteration's routing decision in every iteration (CoE eq. 8
      ablation) instead of one router per iteration.
    residual: 'inner' (eq. 5, default), 'outer' (eq. 9) or 'init' (eq. 10).
    stream: how the chain's own residual (its output contains x^(0) = x = RMSNorm(h) in every
      residual mode) meets the decoder's residual stream h:
      'once' (default): the block returns its output minus x^(0), the experts' updates only, so
        the layer is h + updates and equals the standard layer when the experts output zero.
      'literal': the block returns the chain's output, so the layer is h + x + updates (x
        counted twice, as in this library before the fix).
      'reference': the CoE authors' code: the layer's output *is* the chain's output,
        RMSNorm(h) + updates, replacing the stream h instead of adding to it.
    score_fn: the iterations' routers' score function: None (default) ``router.score_fn``;
      'softmax' is CoE eq. 7 (softmax over N, then top-K_t).
    iteration_scales: give every iteration after the first a learned scalar a_t that scales
      its update (routed and shared experts' outputs) before the residual, x^(t) =
      a_t (sum_i g_t,i E_i(x^(t-1)) + shared) + x^(t-1). Not in the CoE paper: False
      (default) is its chain. A fresh model starts at a_t = 1 (the paper's chain at
      initialisation); a pre-trained MoE converted to CoE starts at a_t = 0, its second
      router a copy of the first, so that the chain computes the MoE until training opens
      the later iterations (:mod:`dagmoe_jax.families.moe.conversion`). Not weight-decayed.
    router, experts: the routers' and the routed (and shared) experts' configs, as the MoE
      family's (the chain sums each iteration: it has no aggregation).
    """

    # No Hugging Face family holds this block (a class attribute, not a field).
    hf_family = None
    kind: str = dataclasses.field(default="coe", init=False)
    iterations: int = 2
    top_k_per_iter: Optional[int] = None
    shared_router: bool = False
    residual: str = "inner"
    stream: str = "once"
    score_fn: Optional[str] = None
    iteration_scales: bool = False
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    experts: ExpertConfig = dataclasses.field(default_factory=ExpertConfig)

    def __post_init__(self):
        _positive("CoEConfig", "iterations", self.iterations)
        if self.score_fn is not None:
            _choice("CoEConfig", "score_fn", self.score_fn, SCORE_FNS)
        if self.top_k_per_iter is not None:
            _positive("CoEConfig", "top_k_per_iter", self.top_k_per_iter)
        _choice("CoEConfig", "residual", self.residual, COE_RESIDUALS)
        _choice("CoEConfig", "stream", self.stream, COE_READINGS)
        check_nested(self)
        k_t, n = self.resolved_top_k, self.experts.num_experts
        _check(k_t >= 1, "CoEConfig", "top_k_per_iter", k_t,
               f"an integer >= 1 (router.top_k={self.router.top_k} // "
               f"iterations={self.iterations} is 0; set top_k_per_iter)")
        _check(k_t <= n, "CoEConfig", "top_k_per_iter", k_t, f"an integer in [1, num_experts={n}]")
        check_groups(self.router, n, k_t)

    @property
    def resolved_top_k(self) -> int:
        """K_t, the experts per iteration (CoE eq. 7 uses K / C)."""
        return self.top_k_per_iter if self.top_k_per_iter is not None else (
            self.router.top_k // self.iterations)

    @property
    def iteration_router(self) -> RouterConfig:
        """The iterations' routers' config: ``router`` with ``score_fn`` when it is set.
        'softmax' is CoE eq. 7: g_t,i = s_t,i for the top K_t of s_t = Softmax(e_t^T x^(t-1))
        over all N experts, not renormalised (``router.renormalize``)."""
        if self.score_fn is None:
            return self.router
        return dataclasses.replace(self.router, score_fn=self.score_fn)

    @staticmethod
    def from_legacy(blob: dict) -> dict:
        """This block's fields in a model config saved while they sat at its top level (its own
        under ``coe``; ``ModelConfig.migrate``). The chain summed: it never had an aggregation."""
        return {**(blob.get("coe") or {}), "router": blob.get("router") or {},
                "experts": blob.get("experts") or {}}

    @property
    def label(self) -> str:
        """The family's name in progress lines."""
        return "CoE"

    def describe(self) -> str:
        """The block in a few words: 'CoE of 32 experts, top 4, 2 iterations'."""
        return (f"CoE of {self.experts.num_experts} experts, top {self.router.top_k}, "
                f"{self.iterations} iterations")
