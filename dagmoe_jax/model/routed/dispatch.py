"""Getting tokens to their experts and back (docs/design.md section 3).

Each strategy takes tokens ``x`` [T, d] and the router's expert ids [T, K] and returns the
selected experts' outputs [T, K, d] in rank order, plus a keep mask [T, K] (False where capacity
dropped the assignment; its output is zero). With no drops the three strategies agree exactly up
to float rounding: ``dense`` is the oracle the tests compare against.

These are the single-device (global-view) strategies;
:mod:`dagmoe_jax.model.routed.expert_parallel` runs 'capacity' and 'dropless' across a device
mesh with the same building blocks (:func:`capacity_gather`, :func:`capacity_combine`,
:func:`grouped_ffn`). Both take one :class:`DispatchPlan`, fixed when the experts are built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from dagmoe_jax.config import ExecutionConfig, ExpertConfig
from dagmoe_jax.kernels.gpu_grouped_matmul import mgpu_grouped_matmul, triton_grouped_matmul
from dagmoe_jax.kernels.grouped_matmul import cpu_grouped_matmul
from dagmoe_jax.kernels.pallas import gmm_grouped_matmul
from dagmoe_jax.model.layers import swiglu
from dagmoe_jax.parallel import constrain
from dagmoe_jax.parallel.axes import MeshLayout

ExpertWeights = Tuple[jax.Array, jax.Array, jax.Array]  # w_gate, w_up [N,d,h]; w_down [N,h,d]

DISPATCH_SCOPE = "moe_dispatch"
"""The ``jax.named_scope`` of one device's dispatch (:func:`dispatch`, and the body of the
expert-parallel ``shard_map``, not the resharding of its weights at the boundary), so a
compiled program's cost can be read by part (compile/scopes.py)."""
EXPERT_FFN_SCOPE = "expert_ffn"
"""The scope of the experts' SwiGLU inside :data:`DISPATCH_SCOPE`: the dispatch is the rest."""

REFERENCE_EXECUTION = ExecutionConfig(fuse_projections=True, grouped_matmul="ragged_dot",
                                      expert_exchange="all_gather")
"""One device's dispatch choices, for experts built outside a settled model (tests, benchmarks)."""


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """How one block's routed tokens reach their experts and back, fixed when the experts are
    built: what is computed, how it runs on this machine, and where.

    experts: the ``ExpertConfig``: its ``dispatch`` ('capacity', with C = ceil(capacity_factor
      T K / N) slots per expert, or 'dropless') and, across expert shards, its
      ``exchange_buffer``;
    execution: the settled ``ExecutionConfig`` (:func:`dagmoe_jax.model.settle.settle`; default
      :data:`REFERENCE_EXECUTION`): ``fuse_projections`` (as
      :func:`~dagmoe_jax.model.layers.swiglu`), ``grouped_matmul`` (how 'dropless' runs:
      :func:`grouped_ffn`, or 'einsum', :func:`dense_dispatch`) and ``expert_exchange`` (how
      expert-parallel 'dropless' moves tokens);
    layout: the mesh the dispatch spans (None: one device).
    """

    experts: ExpertConfig
    execution: ExecutionConfig = REFERENCE_EXECUTION
    layout: Optional[MeshLayout] = None

    @property
    def dense(self) -> bool:
        """Whether every expert runs on every token ('dropless' as 'einsum'): one device's
        program even under a mesh, whose sharding constraints partition it."""
        return self.experts.dispatch == "dropless" and self.execution.grouped_matmul == "einsum"


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * T * K / N), at least 1 slot."""
    return max(1, int(math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


def apply_experts(buffer: jax.Array, weights: ExpertWeights, fused: bool = True) -> jax.Array:
    """Every expert's SwiGLU on its own rows: buffer [N, C, d] -> [N, C, d], a vmap over N;
    ``fused``: gate and up projections as one matmul (:func:`~dagmoe_jax.model.layers.swiglu`)."""
    with jax.named_scope(EXPERT_FFN_SCOPE):
        return jax.vmap(lambda b, *w: swiglu(b, *w, fused=fused))(buffer, *weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def take_rows(src: jax.Array, idx: jax.Array, inverse: jax.Array,
              permutation: bool = False, copies_first: bool = False) -> jax.Array:
    """``src[idx]`` (rows; an out-of-range index gives a zero row) whose gradient is a gather too.

    ``idx`` must map rows one-to-one (a partial permutation, as dispatch and combine are), and
    ``inverse`` [src_rows, ...] lists for each source row the output rows that read it
    (out of range where none). The backward pass is then ``sum(dout[inverse], axis=1..)``, a
    gather, instead of the scatter-add autodiff would emit (slow on CPU, serialised on GPU).
    ``permutation``: every index of ``idx`` and ``inverse`` is in range (a full permutation, as
    the ragged exchange's are), so the gathers need no bounds select: on TPU the select after
    each gather was a pass over the rows of its own. ``copies_first``: ``inverse`` is
    [copies, src_rows] instead (the K assignments of a token rank-major, whose gradient rows
    then sum over the major axis: on TPU no [T, K, d] relayout with K = 4 in the 8-row tiles).
    """
    mode = "promise_in_bounds" if permutation else "fill"
    return src.at[idx].get(mode=mode, fill_value=None if permutation else 0)


def _take_rows_fwd(src, idx, inverse, permutation, copies_first):
    return take_rows(src, idx, inverse, permutation, copies_first), inverse


def _take_rows_bwd(permutation, copies_first, inverse, dout):
    flat = dout.reshape(-1, dout.shape[-1])
    mode = "promise_in_bounds" if permutation else "fill"
    dsrc = flat.at[inverse].get(mode=mode, fill_value=None if permutation else 0)
    if copies_first:
        return dsrc.reshape(-1, inverse.shape[-1], flat.shape[-1]).sum(axis=0), None, None
    dsrc = dsrc.reshape(inverse.shape[0], -1, flat.shape[-1]).sum(axis=1)
    return dsrc, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def capacity_slots(indices: jax.Array, num_experts: int, capacity: int):
    """Slot of each assignment in its expert's buffer, GShard priority (rank-major).

    All tokens' first choices claim slots before any second choice, tokens in order within a rank.
    Returns (slot [T, K] = expert * C + position, keep [T, K] = position < C).
    """
    t, k = indices.shape
    flat = indices.T.reshape(-1)                                   # [K*T], rank-major
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1).reshape(k, t).T
    keep = position < capacity
    return indices * capacity + position, keep


def capacity_gather(x: jax.Array, indices: jax.Array, num_experts: int, capacity: int):
    """Tokens ``x`` [T, d] into their experts' slots: buffer [N, C, d] (empty slots zero).

    Returns (buffer, slot, holder, keep): ``slot`` [T, K] each assignment's row of the flattened
    buffer (out of range where dropped), ``holder`` [N * C] the assignment each slot holds (out
    of range where empty), both for :func:`capacity_combine`; ``keep`` [T, K] as
    :func:`capacity_slots`.
    """
    t, d = x.shape
    n, cap, k = num_experts, capacity, indices.shape[1]
    slot, keep = capacity_slots(indices, n, cap)
    slot = jnp.where(keep, slot, n * cap)                          # out of range: dropped
    # assignment (t * K + k) held by each slot; t * K (out of range) where the slot is empty
    holder = jnp.full((n * cap,), t * k, jnp.int32).at[slot.reshape(-1)].set(
        jnp.arange(t * k, dtype=jnp.int32), mode="drop")
    token = jnp.where(holder < t * k, holder // k, t)
    buffer = take_rows(x, token, slot).reshape(n, cap, d)
    return buffer, slot, holder, keep


def capacity_combine(y: jax.Array, slot: jax.Array, holder: jax.Array) -> jax.Array:
    """Expert outputs y [N, C, d] back to the assignments: [T, K, d], zero where dropped."""
    n, cap, d = y.shape
    return take_rows(y.reshape(n * cap, d), slot, holder)


def capacity_dispatch(x: jax.Array, indices: jax.Array, weights: ExpertWeights,
                      capacity_factor: float, fused: bool = True):
    """Fixed-capacity dispatch: gather into [N, C, d], batched experts, gather back."""
    n, k = weights[0].shape[0], indices.shape[1]
    cap = expert_capacity(x.shape[0], k, n, capacity_factor)
    buffer, slot, holder, keep = capacity_gather(x, indices, n, cap)
    buffer = constrain(buffer, ("expert", "expert_slots", "embed"))
    y = constrain(apply_experts(buffer, weights, fused), ("expert", "expert_slots", "embed"))
    return capacity_combine(y, slot, holder), keep


GROUPED_MATMUL: dict[str, Callable] = {
    "ragged_dot": jax.lax.ragged_dot,
    "gmm": gmm_grouped_matmul,
    "cpu_gmm": cpu_grouped_matmul,
    "mgpu": mgpu_grouped_matmul,
    "triton": triton_grouped_matmul,
}
"""The settled ``ExecutionConfig.grouped_matmul`` -> ``f(lhs [M, k], rhs [N, k, n], sizes [N])``."""
ZEROING_PAST_GROUPS = frozenset({"gmm"})
"""The grouped matmuls that zero the rows past ``sum(sizes)`` by selects of their own and take
``zero_tail=False`` to leave them out (megablox ``gmm``: on TPU each select was a pass
over the [T K, d] rows, benchmarks/RESULTS.md)."""


def grouped_ffn(xs: jax.Array, weights: ExpertWeights, sizes: jax.Array,
                grouped_matmul: str = "ragged_dot", zero_tail: bool = True) -> jax.Array:
    """SwiGLU of rows ``xs`` [M, d] sorted by expert, ``sizes`` [N] rows per expert, by the
    grouped matmul ``grouped_matmul`` (:data:`GROUPED_MATMUL`); rows past ``sum(sizes)`` give
    zeros, or, ``zero_tail=False``, whatever the kernel leaves there: for a caller that has
    none (``sum(sizes) == M``) or never reads them nor lets their gradients reach what it
    reads, which spares the kernels that zero them by selects (:data:`ZEROING_PAST_GROUPS`)
    those passes.
    The gate and up projections stay two grouped matmuls: as one on the weights side by side
    the compiled MoE-l step was slower for the same FLOPs (benchmarks/RESULTS.md)."""
    if grouped_matmul not in GROUPED_MATMUL:
        raise ValueError(f"grouped_matmul={grouped_matmul!r} is invalid: expected one of "
                         f"{sorted(GROUPED_MATMUL)} (settle the config first)")
    mm = GROUPED_MATMUL[grouped_matmul]
    if not zero_tail and grouped_matmul in ZEROING_PAST_GROUPS:
        mm = functools.partial(mm, zero_tail=False)
    w_gate, w_up, w_down = weights
    with jax.named_scope(EXPERT_FFN_SCOPE):
        h = jax.nn.silu(mm(xs, w_gate, sizes)) * mm(xs, w_up, sizes)
        return mm(h, w_down, sizes)


def dropless_dispatch(x: jax.Array, indices: jax.Array, weights: ExpertWeights,
                      grouped_matmul: str = "ragged_dot"):
    """Exact dispatch: sort the T*K assignments by expert and run grouped matmuls
    (:func:`grouped_ffn`)."""
    t, d = x.shape
    n, k = weights[0].shape[0], indices.shape[1]
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)                         # sorted row -> assignment
    rank = jnp.argsort(order)                                      # assignment -> sorted row
    tiled = grouped_matmul in TILED_ROWS
    xs = take_rows_of_tokens(x, order, rank, k, tiled)
    sizes = jnp.bincount(flat, length=n).astype(jnp.int32)
    ys = grouped_ffn(xs, weights, sizes, grouped_matmul, zero_tail=False)   # sum(sizes) = T K
    return combine_assignments(ys, rank, order, k, tiled), jnp.ones((t, k), bool)


TILED_ROWS = frozenset({"gmm"})
"""The grouped matmuls of a backend whose arrays are laid out in tiles of rows (megablox
``gmm``, settled on TPU alone), where dropless dispatch gathers a token's K rows as [K, T, d]:
there [T, K, d] with K = 4 half-fills the 8-row tiles and every reshape between it and the
[T K, d] rows was a relayout copy (benchmarks/RESULTS.md), while [K, T, d]'s rows are a free
reshape. Elsewhere the gathers make [T, K, d], whose transpose the [K, T, d] form needs cost
the CPU's MoE-s step 3%."""


def take_rows_of_tokens(x: jax.Array, order: jax.Array, rank: jax.Array, k: int,
                        tiled: bool = False) -> jax.Array:
    """The tokens' rows ``x`` [T, d] in the sorted order of their assignments: row r is token
    ``order[r] // k``; ``rank`` [T K] is the inverse permutation (assignment t K + j -> sorted
    row), whose gradient gather sums each token's K rows, taken as [K, T, d] when ``tiled``
    (:data:`TILED_ROWS`), else as [T, K, d]."""
    inverse = rank.reshape(-1, k)
    return take_rows(x, order // k, inverse.T if tiled else inverse, True, tiled)


def combine_assignments(ys: jax.Array, rank: jax.Array, order: jax.Array, k: int,
                        tiled: bool = False) -> jax.Array:
    """The sorted rows ``ys`` [T K, d] back to their assignments [T, K, d] (``rank`` and
    ``order`` as :func:`take_rows_of_tokens`); when ``tiled``, gathered as [K, T, d] and
    transposed, which XLA folds into the consumers (the weighted sum over K)."""
    if not tiled:
        return take_rows(ys, rank.reshape(-1, k), order, True)
    t = rank.shape[0] // k
    out = take_rows(ys, rank.reshape(t, k).T, (order % k) * t + order // k, True)  # [K, T, d]
    return jnp.swapaxes(out, 0, 1)


def dense_dispatch(x: jax.Array, indices: jax.Array, weights: ExpertWeights,
                   fused: bool = True):
    """Every expert on every token, then pick the selected ones: dropless dispatch run as
    ``grouped_matmul='einsum'``, the test oracle (N x the work)."""
    y = apply_experts(jnp.broadcast_to(x, (weights[0].shape[0],) + x.shape), weights,
                      fused)                                                          # [N,T,d]
    out = y[indices, jnp.arange(x.shape[0])[:, None]]
    return out, jnp.ones(indices.shape, bool)


def dispatch(plan: DispatchPlan, x, indices, weights: ExpertWeights):
    """Outputs [T, K, d] and keep mask [T, K] of the experts ``indices`` on tokens ``x`` [T, d]
    by one device's dispatch as ``plan`` says (its layout is not read: the global view). Its
    instructions carry :data:`DISPATCH_SCOPE`."""
    with jax.named_scope(DISPATCH_SCOPE):
        return _dispatch(plan, x, indices, weights)


def _dispatch(plan: DispatchPlan, x, indices, weights: ExpertWeights):
    mode, fused = plan.experts.dispatch, plan.execution.fuse_projections
    if mode == "capacity":
        return capacity_dispatch(x, indices, weights, plan.experts.capacity_factor, fused)
    if mode != "dropless":
        raise ValueError(f"dispatch={mode!r} is invalid: expected 'capacity' or 'dropless'")
    if plan.dense:
        return dense_dispatch(x, indices, weights, fused)
    return dropless_dispatch(x, indices, weights, plan.execution.grouped_matmul)
