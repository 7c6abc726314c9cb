"""The routed experts: N SwiGLU FFNs stored stacked and applied as one vmapped FFN.

On one device the tokens reach them by :func:`dagmoe_jax.model.dispatch.dispatch`; inside
:func:`dagmoe_jax.parallel.activate` with a multi-device mesh, 'capacity' and 'dropless' dispatch
run across devices (:mod:`dagmoe_jax.parallel.expert`: all-to-all over the ``expert`` axis).
"""

from __future__ import annotations

import jax
from flax import nnx

from dagmoe_jax.model.dispatch import dispatch
from dagmoe_jax.model.layers import make_param, normal
from dagmoe_jax.parallel import expert as expert_parallel  # a module: import cycles stay harmless
from dagmoe_jax.parallel.mesh import parallel_active


class Experts(nnx.Module):
    """w_gate, w_up [N, d, d_r] and w_down [N, d_r, d], the expert axis leading (sharded over
    the mesh's ``expert`` axis)."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, std: float, dtype, *,
                 rngs: nnx.Rngs):
        self.dtype = dtype
        init = normal(std)
        self.w_gate = make_param(rngs, init, (num_experts, d_model, hidden),
                                 ("expert", "embed", "expert_mlp"))
        self.w_up = make_param(rngs, init, (num_experts, d_model, hidden),
                               ("expert", "embed", "expert_mlp"))
        self.w_down = make_param(rngs, init, (num_experts, hidden, d_model),
                                 ("expert", "expert_mlp", "embed"))

    def __call__(self, x: jax.Array, indices: jax.Array, mode: str, capacity_factor: float):
        """Outputs [T, K, d] of the experts ``indices`` [T, K] on tokens ``x`` [T, d], and the
        keep mask [T, K] (False where capacity dropped the assignment)."""
        weights = tuple(w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        if mode != "dense" and parallel_active():
            return expert_parallel.sharded_dispatch(mode, x.astype(self.dtype), indices, weights,
                                                    capacity_factor)
        return dispatch(mode, x.astype(self.dtype), indices, weights, capacity_factor)
