"""The routed experts: N SwiGLU FFNs stored stacked and applied as one vmapped FFN.

On one device the tokens reach them by :func:`dagmoe_jax.model.routed.dispatch.dispatch`; when the
model is built with a multi-device :class:`~dagmoe_jax.parallel.axes.MeshLayout`, 'capacity'
and 'dropless' dispatch run across devices (:mod:`dagmoe_jax.model.routed.expert_parallel`:
all-to-all over the ``expert`` axis).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ExpertConfig
from dagmoe_jax.model.layers import make_param, normal
from dagmoe_jax.model.routed.dispatch import REFERENCE_EXECUTION, DispatchPlan, dispatch
from dagmoe_jax.model.routed.expert_parallel import sharded_dispatch
from dagmoe_jax.parallel.axes import MeshLayout


class Experts(nnx.Module):
    """w_gate, w_up [N, d, d_r] and w_down [N, d_r, d], the expert axis leading (sharded over
    the mesh's ``expert`` axis).

    cfg: the ``ExpertConfig`` (N = num_experts, d_r = expert_hidden; its ``dispatch``:
    'capacity' or 'dropless', with C = ceil(capacity_factor * T * K / N) for 'capacity');
    execution: a settled ``ExecutionConfig`` (None: one device's reference choices,
    :data:`~dagmoe_jax.model.routed.dispatch.REFERENCE_EXECUTION`); layout: the mesh to
    dispatch across (None: one device). The three are the experts' one
    :class:`~dagmoe_jax.model.routed.dispatch.DispatchPlan` (``plan``), fixed here.
    """

    def __init__(self, cfg: ExpertConfig, d_model: int, *, std: float, dtype,
                 execution: Optional[ExecutionConfig] = None,
                 layout: Optional[MeshLayout] = None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.plan = DispatchPlan(cfg, execution or REFERENCE_EXECUTION, layout)
        self.dtype = dtype
        num_experts, hidden = cfg.num_experts, cfg.expert_hidden
        init = normal(std)
        self.w_gate = make_param(rngs, init, (num_experts, d_model, hidden),
                                 ("expert", "embed", "expert_mlp"), param_dtype)
        self.w_up = make_param(rngs, init, (num_experts, d_model, hidden),
                               ("expert", "embed", "expert_mlp"), param_dtype)
        self.w_down = make_param(rngs, init, (num_experts, hidden, d_model),
                                 ("expert", "expert_mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array, indices: jax.Array):
        """Outputs [T, K, d] of the experts ``indices`` [T, K] on tokens ``x`` [T, d], and the
        keep mask [T, K] (False where capacity dropped the assignment)."""
        weights = tuple(w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        across_mesh = self.plan.layout is not None and not self.plan.dense
        run = sharded_dispatch if across_mesh else dispatch
        return run(self.plan, x.astype(self.dtype), indices, weights)
