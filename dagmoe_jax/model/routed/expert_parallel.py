"""Expert parallelism: MoE token dispatch across devices inside ``jax.shard_map``.

:class:`~dagmoe_jax.model.routed.experts.Experts` calls :func:`sharded_dispatch` when the model was
built with a :class:`~dagmoe_jax.parallel.axes.MeshLayout` (a mesh of more than one device,
handed over by the run, never read from the context); otherwise the single-device dispatch of
:mod:`dagmoe_jax.model.routed.dispatch` runs unchanged. Only the dispatch is manual: routing, the router
losses (balance loss from the global f_i and P_i, z-loss over all tokens) and the aggregators
(sum, DAG, MLP) stay in the global view, where XLA computes them on the sharded tokens exactly
as on one device.

Layout inside the ``shard_map`` (mesh axes from the rules: ``batch`` -> the token axes, by
default ``data, fsdp, expert``; ``expert`` -> ``expert``; ``expert_mlp`` -> ``tensor``; axes of
size 1 ignored): each device holds T_loc = T / (data * fsdp * expert) tokens and the experts
[N / E, d, d_r / tensor] of its shard (E = the ``expert`` size; the ``fsdp`` shards of ``embed``
are all-gathered by the ``shard_map`` input resharding, their gradients reduce-scattered back).
With E = 1 (pure data parallelism) no tokens move: each device dispatches its own, in
dropless mode by the single-device dispatch itself (whole permutations, and a grouped matmul
told that every row is in a group: no bounds or zeroing selects, each a pass over the rows on
TPU).

* ``capacity`` (GShard / MaxText): every device is its own token group. It fills local buffers
  [N, C_loc, d] with C_loc = ceil(capacity_factor * T_loc * K / N) (GShard priority within the
  device); an ``all_to_all`` over ``expert`` turns them into [N / E, E * C_loc, d] for its local
  experts; the vmapped SwiGLU runs (hidden units split over ``tensor``, partial outputs summed
  with ``psum``); a second ``all_to_all`` brings [N, C_loc, d] back for the combine. Which
  assignments drop therefore depends on the per-device groups: with no drops the result equals
  the single-device one, with drops it can differ (as in every grouped dispatch); ``keep`` (and
  so ``dropped_fraction``) reports this layout's drops exactly.
* ``dropless`` moves tokens one of two ways (``ExecutionConfig.expert_exchange``, settled per
  backend); both are exact (nothing drops):

  - ``ragged_all_to_all`` (GPU, TPU): each device sorts its T_loc * K assignments by expert, so
    the rows for each expert shard are one contiguous slice, and sends each slice to its
    shard alone (``jax.lax.ragged_all_to_all``; slice sizes and offsets come from an
    ``all_to_all`` of the per-expert counts and an ``all_gather`` of the slice sizes). The
    receiver runs the grouped matmul on what arrived where it landed (by sending shard,
    then local expert: E x N / E groups over the local weights repeated once per sender), and a
    second ragged all-to-all returns every row to the slot it left from. Its receive buffer
    holds E * T_loc * K rows (every assignment of the group could choose one shard's experts),
    but only the assignments themselves cross the network.
  - ``all_gather`` (CPU: XLA:CPU does not implement the ragged collective, "HLO opcode
    ragged-all-to-all is not supported"): all-gather the tokens and their expert ids over
    ``expert`` ([E * T_loc, d]), run the assignments of the local experts through the grouped
    matmul (the others masked to zero rows), ``psum_scatter`` the [E * T_loc, K, d] outputs
    back to their devices. Each device sorts E * T_loc * K rows and receives E x its tokens:
    fine for a few expert shards, wasteful for many.

  Either way the partial outputs of the ``tensor``-split hidden units are summed with
  ``psum``. ``ExpertConfig.exchange_buffer`` bounds what a shard receives to B rows, the
  same rule for both exchanges (each shard keeps the first B in the order sending device,
  local expert, the sender's token order; the rest drop, ``keep`` False); the ragged
  exchange's buffers and sorts then hold B rows instead of E * T_loc * K. The CPU suite
  checks the ragged exchange's bookkeeping (and the buffer's rule) against the single-device
  dispatch with an all-gather emulation of the collective (tests/test_ragged_exchange.py),
  and that it lowers for TPU and CUDA (tests/test_lowering.py).
* ``dense`` (the test oracle) is not sharded by hand: it runs the global-view code.
* A token count the token axes do not divide (e.g. sampling one sequence) also runs the
  global-view code, which XLA partitions through the sharding constraints (correct, slower).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.lax import ragged_all_to_all
from jax.sharding import PartitionSpec as P

from dagmoe_jax.model.routed.dispatch import (DISPATCH_SCOPE, TILED_ROWS, DispatchPlan,
                                              ExpertWeights, apply_experts, capacity_combine,
                                              capacity_gather, combine_assignments, dispatch,
                                              dropless_dispatch, expert_capacity, grouped_ffn,
                                              take_rows, take_rows_of_tokens)
from dagmoe_jax.kernels.pallas import GMM_TILE
from dagmoe_jax.parallel.axes import MeshLayout

AxisNames = Tuple[str, ...]


def rule_axes(rules, name: str) -> AxisNames:
    """The mesh axes a logical ``name`` maps to under ``rules`` (a tuple, maybe empty)."""
    target = dict(rules).get(name)
    return (target,) if isinstance(target, str) else tuple(target or ())


def _axis(names: AxisNames):
    """A collective's ``axis_name``: None for no axes, the name for one, else the tuple."""
    return None if not names else names[0] if len(names) == 1 else names


def dispatch_axes(layout: MeshLayout) -> Tuple[AxisNames, AxisNames, AxisNames]:
    """(token axes, expert axes, hidden axes) of the sharded dispatch, mesh axes of size 1
    dropped; a one-line ``ValueError`` for rules it cannot serve."""
    rules, sizes = layout.rules, dict(layout.axis_sizes)
    live = lambda axes: tuple(a for a in axes if sizes.get(a, 1) > 1)
    tokens = live(rule_axes(rules, "batch"))
    experts = live(rule_axes(rules, "expert"))
    hidden = tuple(a for a in live(rule_axes(rules, "expert_mlp")) if a not in experts)
    if not set(experts) <= set(tokens):
        raise ValueError(f"expert-parallel dispatch: the 'expert' rule's mesh axes {experts} must "
                         f"also shard the 'batch' rule's token axes {tokens}")
    if set(hidden) & set(tokens):
        raise ValueError(f"expert-parallel dispatch: the 'expert_mlp' rule's mesh axes {hidden} "
                         f"must not shard the tokens ('batch' -> {tokens})")
    return tokens, experts, hidden


def _capacity_shard(x, indices, weights, *, num_experts: int, capacity_factor: float,
                    experts: Optional[object], hidden: Optional[object], fused: bool):
    """One device's capacity dispatch: local buffers, all-to-all to the local experts, back."""
    cap = expert_capacity(x.shape[0], indices.shape[1], num_experts, capacity_factor)
    buffer, slot, holder, keep = capacity_gather(x, indices, num_experts, cap)     # [N, C, d]
    if experts is not None:
        buffer = jax.lax.all_to_all(buffer, experts, 0, 1, tiled=True)           # [N/E, E*C, d]
    y = apply_experts(buffer, weights, fused)
    if hidden is not None:
        y = jax.lax.psum(y, hidden)
    if experts is not None:
        y = jax.lax.all_to_all(y, experts, 1, 0, tiled=True)                     # [N, C, d]
    return capacity_combine(y, slot, holder), keep


def _buffer_rows(exchange_buffer: Optional[float], rows: int, shards: int) -> Optional[int]:
    """The rows B = ceil(buffer * rows) a shard may receive (``ExpertConfig.exchange_buffer``,
    ``rows`` = T_loc * K its balanced share), or None when that holds every case (E * rows)."""
    if exchange_buffer is None or math.ceil(exchange_buffer * rows) >= shards * rows:
        return None
    return math.ceil(exchange_buffer * rows)


def _dropless_shard(x, indices, weights, *, experts: Optional[object], hidden: Optional[object],
                    grouped_matmul: str, exchange_buffer: Optional[float] = None):
    """One device's dropless dispatch (all-gather fallback): every token of the expert group,
    only the assignments of this device's experts, outputs reduce-scattered home. With a
    bounded buffer, the assignments the rule of ``ExpertConfig.exchange_buffer`` drops count as
    another shard's and return zero."""
    t_loc, k = indices.shape
    n_local = weights[0].shape[0]
    if experts is None:
        # no expert axis: every assignment is this device's (a buffer of at least the balanced
        # share holds them all), a whole permutation of the rows: no bounds selects in its
        # gathers, none in the grouped matmul (benchmarks/RESULTS.md)
        out, keep = dropless_dispatch(x, indices, weights, grouped_matmul)
        return (out if hidden is None else jax.lax.psum(out, hidden)), keep
    x = jax.lax.all_gather(x, experts, axis=0, tiled=True)                       # [E*T, d]
    indices = jax.lax.all_gather(indices, experts, axis=0, tiled=True)
    first = jax.lax.axis_index(experts) * n_local
    e = jax.lax.axis_size(experts)
    t = x.shape[0]
    local_id = indices.reshape(-1) - first
    local = (local_id >= 0) & (local_id < n_local)
    cap = _buffer_rows(exchange_buffer, t_loc * k, e)
    if cap is not None:
        # the ragged exchange's order on this shard: by sending device, local expert, position
        source = jnp.arange(t * k) // (t_loc * k)
        place = jnp.argsort(jnp.argsort(jnp.where(local, source * n_local + local_id,
                                                  e * n_local), stable=True))
        local = local & (place < cap)
    key = jnp.where(local, local_id, n_local)                # other shards' experts sort last
    order = jnp.argsort(key, stable=True)                    # sorted row -> assignment
    rank = jnp.argsort(order)                                # assignment -> sorted row
    m = t * k
    row_of = jnp.where(local, rank, m).reshape(t, k)         # out of range: not local
    held_by = jnp.where(local[order], order, m)
    xs = take_rows(x, jnp.where(local[order], order // k, t), row_of)
    sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
    # other shards' assignments sort last and are never read back (row_of out of range)
    out = take_rows(grouped_ffn(xs, weights, sizes, grouped_matmul, zero_tail=False), row_of,
                    held_by)                                                     # [E*T, K, d]
    keep = jnp.ones((t_loc, k), bool)
    if cap is not None:       # kept on its expert's shard: one count of 1
        keep = jax.lax.psum_scatter(local.reshape(t, k).astype(jnp.int32), experts,
                                    scatter_dimension=0, tiled=True) > 0
    out = jax.lax.psum_scatter(out, experts, scatter_dimension=0, tiled=True)      # [T, K, d]
    if hidden is not None:
        out = jax.lax.psum(out, hidden)
    return out, keep


def exchange_block(grouped_matmul: str, dtype) -> int:
    """The rows the ragged exchange moves as one unit: those of one (8, 128) tile (16 in
    bfloat16) where arrays are laid out in tiles of rows (:data:`~dagmoe_jax.model.routed.dispatch.
    TILED_ROWS`, TPU), else 1. XLA:TPU's ragged all-to-all moves rows one by one only in a
    layout where each row is contiguous, into which it relayouts its operand and out of which
    its result, a copy of each buffer each way (benchmarks/RESULTS.md); [rows / 16, 16, d]
    blocks are contiguous in the tiled layout itself and need neither."""
    return 32 // jnp.dtype(dtype).itemsize if grouped_matmul in TILED_ROWS else 1


def _ceil_to(n, block: int):
    return -(-n // block) * block


def _new_buffer(like, rows: int, zeros: bool, row_shape=None):
    """A buffer of ``rows`` rows shaped (unless ``row_shape``) and typed as ``like``'s,
    varying over the same manual mesh axes (as ``jnp.zeros_like`` would be)."""
    shape = (rows,) + tuple(like.shape[1:] if row_shape is None else row_shape)
    buffer = jnp.zeros(shape, like.dtype) if zeros else jax.lax.empty(shape, like.dtype)
    varying = lambda a: jax.typeof(a).mat.varying           # noqa: E731 (jax 0.11's name)
    axes = tuple(sorted(varying(like) - varying(buffer)))
    return jax.lax.pcast(buffer, axes, to="varying") if axes else buffer


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def exchange_rows(operand, input_offsets, send_sizes, output_offsets, recv_sizes,
                  rows: int, zeros: bool, zero_grads: bool, axis_name):
    """``ragged_all_to_all`` of ``operand``'s slices into a new buffer of ``rows`` rows, zeros
    where nothing lands when ``zeros``, else uninitialised (``lax.empty``: no pass writing
    zeros over it), for a caller that never reads those rows. Its VJP is the exchange back,
    the cotangents of the rows that never left ``operand`` zeros when ``zero_grads``, else
    uninitialised too. JAX's own transpose always fills them from a zero buffer of
    ``operand``'s size and masks the output buffer's cotangent by a select: two passes over
    the rows the exchange's callers need not pay for (its output buffer is made here, with no
    gradient)."""
    return ragged_all_to_all(operand, _new_buffer(operand, rows, zeros), input_offsets,
                             send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def _exchange_rows_fwd(operand, input_offsets, send_sizes, output_offsets, recv_sizes,
                       rows, zeros, zero_grads, axis_name):
    out = exchange_rows(operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows,
                        zeros, zero_grads, axis_name)
    back = jax.lax.all_to_all(jnp.stack([output_offsets, input_offsets]), axis_name, 1, 1,
                              tiled=True)   # where each slice landed and where it came from
    # operand's rows and manual axes, in no memory: what the gradient's buffer is made like
    return out, (back, send_sizes, recv_sizes, operand[:, :0])


def _exchange_rows_bwd(rows, zeros, zero_grads, axis_name, residuals, cotangent):
    del rows, zeros
    (landed, came_from), send_sizes, recv_sizes, like = residuals
    buffer = _new_buffer(like, like.shape[0], zero_grads, cotangent.shape[1:])
    grad = ragged_all_to_all(cotangent, buffer, landed,
                             recv_sizes, came_from, send_sizes, axis_name=axis_name)
    return grad, None, None, None, None


exchange_rows.defvjp(_exchange_rows_fwd, _exchange_rows_bwd)


def _ragged_exchange_shard(x, indices, weights, *, experts, hidden, grouped_matmul: str,
                           exchange_buffer: Optional[float] = None):
    """One device's dropless dispatch with ``ragged_all_to_all`` over the expert axes (module
    docstring): each assignment goes to its expert's shard and back, nothing else moves. With
    a bounded buffer (``ExpertConfig.exchange_buffer``) each shard receives at most B rows:
    every sender sends the head of its slice that fits behind the earlier senders', the tail
    stays home and returns zero (``keep`` False).

    Slices move in blocks of :func:`exchange_block` rows: each sender pads its slice for each
    shard to whole blocks, and the receiver runs the padding rows (tokens of no consequence)
    as a group of their own over zero weights, so they neither reach an expert's weights nor
    come back as anything but zeros; their cotangents are zero, so their gathers' gradients
    leave them out."""
    t, k = indices.shape
    d, n_local = x.shape[1], weights[0].shape[0]
    e = jax.lax.axis_size(experts)
    m = t * k
    block = exchange_block(grouped_matmul, x.dtype)
    cap = _buffer_rows(exchange_buffer, m, e)
    rows = e * m if cap is None else cap                     # the receive buffer's real rows
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)                   # sorted row -> assignment
    rank = jnp.argsort(order)                                # assignment -> sorted row
    counts = jnp.bincount(flat, length=e * n_local).astype(jnp.int32).reshape(e, n_local)
    send_sizes = jnp.sum(counts, axis=1)                     # rows for each expert shard
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    # recv[s, j]: rows shard s sends here for local expert j; sent[s, d]: s's slice for d
    recv = jax.lax.all_to_all(counts, experts, 0, 0, tiled=True)
    sent = jax.lax.all_gather(send_sizes, experts, axis=0, tiled=False)      # [E, E]
    me = jax.lax.axis_index(experts)
    fits = sent
    if cap is not None:     # the head of each slice that fits on its shard, the rest stays
        fits = jnp.clip(cap - (jnp.cumsum(sent, axis=0) - sent), 0, sent)  # [sender, receiver]
        recv = jnp.clip(fits[:, me][:, None] - (jnp.cumsum(recv, axis=1) - recv), 0, recv)
    moved = _ceil_to(fits, block)                            # whole blocks of each slice
    place = jnp.cumsum(moved, axis=0) - moved                # its place on its shard
    # each sorted row's receiver, for the padding and the buffer's drops
    shard = None if block == 1 and cap is None else flat[order] // n_local
    if block == 1:
        holder, row_of, m_pad, rows_pad, starts = order, rank, m, rows, input_offsets
    else:                    # the sender's slices, each padded to whole blocks
        padded = _ceil_to(send_sizes, block)
        starts = jnp.cumsum(padded) - padded
        row = starts[shard] + jnp.arange(m) - input_offsets[shard]  # sorted row -> its row
        # blocks are gmm's (exchange_block): the receive buffer is whole row tiles of gmm
        # (else it pads the buffer to them and slices its output back, a copy each way)
        tile = math.lcm(block, GMM_TILE[0])
        m_pad, rows_pad = _ceil_to(m, block) + e * block, _ceil_to(rows + e * block, tile)
        holder = jnp.zeros(m_pad, jnp.int32).at[row].set(order)    # padding: assignment 0
        row_of = row[rank]
    tiled = grouped_matmul in TILED_ROWS
    xs = take_rows_of_tokens(x, holder, row_of, k, tiled)   # [M_pad, d], by global expert
    blocks = lambda a: a.reshape(-1, block, d)               # noqa: E731
    # the receive buffer's rows past what arrives are never read (below), so it is left
    # uninitialised; the rows that stay home (a bounded buffer) get zero gradients
    got = exchange_rows(blocks(xs), starts // block, moved[me] // block, place[me] // block,
                        moved[:, me] // block, rows_pad // block, False, cap is not None,
                        experts).reshape(rows_pad, d)
    # the rows arrived by source shard, each source's sorted by local expert: E x n_local
    # groups in that order (each source's padding a group of its own over zero weights), over
    # the local weights repeated once per source, so the buffer is used where it landed (no
    # sort of it by expert and back: two gathers of the worst-case buffer each way); the
    # weights' gradient sums over the repeats
    sizes, local = recv, weights
    if block > 1:
        sizes = jnp.concatenate([recv, (moved[:, me] - jnp.sum(recv, axis=1))[:, None]], 1)
        local = tuple(jnp.concatenate([w, jnp.zeros_like(w[:1])]) for w in weights)
    ys = grouped_ffn(got, tuple(jnp.tile(w, (e, 1, 1)) for w in local), sizes.reshape(-1),
                     grouped_matmul, zero_tail=False)
    # the buffer's unused tail (past every group) is never sent back, nor its gradient read:
    # the grouped matmul need not zero it (a pass over it each way)
    home = jax.lax.all_to_all(starts, experts, 0, 0, tiled=True)         # where rows came from
    # every row comes back unless the buffer is bounded (a row that stayed home reads zero)
    returned = exchange_rows(blocks(ys), place[:, me] // block, moved[:, me] // block,
                             home // block, moved[me] // block, m_pad // block, cap is not None,
                             False, experts).reshape(m_pad, d)          # sorted
    out = combine_assignments(returned, row_of, holder, k, tiled)       # [T, K, d]
    if hidden is not None:
        out = jax.lax.psum(out, hidden)
    if cap is None:
        return out, jnp.ones((t, k), bool)
    sent_here = jnp.arange(m) - input_offsets[shard] < fits[me][shard]
    return out, sent_here[rank].reshape(t, k)


def _scoped(body, *args):
    """``body(*args)`` with its instructions under :data:`~dagmoe_jax.model.routed.dispatch.
    DISPATCH_SCOPE` (inside the ``shard_map``: its boundary's resharding of the weights and
    their gradients is the parameters' sharding, not the dispatch)."""
    with jax.named_scope(DISPATCH_SCOPE):
        return body(*args)


def sharded_dispatch(plan: DispatchPlan, x: jax.Array, indices: jax.Array,
                     weights: ExpertWeights):
    """:func:`dagmoe_jax.model.routed.dispatch.dispatch` across ``plan.layout``'s mesh (module
    docstring).

    Same inputs and outputs as the single-device dispatch (global view): tokens ``x`` [T, d],
    expert ids [T, K], stacked expert weights; returns outputs [T, K, d] and the keep mask.
    N must divide over the expert axes and d_r over the hidden axes (else a one-line
    ``ValueError``). A token count T the token axes do not divide (sampling a single sequence,
    an odd evaluation batch) falls back to the global-view single-device dispatch, which XLA
    partitions through the sharding constraints: correct, but not expert-parallel. From the
    plan's execution: ``fuse_projections``, gate and up projections as one matmul (settled to
    False on a mesh, where concatenating tensor-sharded weights would move them);
    ``grouped_matmul``, as :func:`~dagmoe_jax.model.routed.dispatch.grouped_ffn` (dropless);
    ``expert_exchange``, how dropless moves tokens between expert shards, 'all_gather' or
    'ragged_all_to_all' (module docstring; with no expert axis nothing moves and this is
    unused). From its experts: ``dispatch``, ``capacity_factor`` and ``exchange_buffer``, the
    same rule either way.
    """
    layout, mode = plan.layout, plan.experts.dispatch
    fused, grouped_matmul = plan.execution.fuse_projections, plan.execution.grouped_matmul
    tokens, experts, hidden = dispatch_axes(layout)
    n, d_r = weights[0].shape[0], weights[0].shape[-1]
    if x.shape[0] % layout.size(tokens):
        # e.g. sampling one sequence on a mesh: the global-view dispatch, which XLA partitions
        # by the sharding constraints alone (correct, single-device capacity semantics, slower)
        return dispatch(plan, x, indices, weights)
    for what, size, axes in (("experts N", n, experts), ("expert hidden d_r", d_r, hidden)):
        if size % layout.size(axes):
            raise ValueError(f"expert-parallel dispatch: {what}={size} is not divisible by the "
                             f"{layout.size(axes)} devices of mesh axes {axes}")
    if mode == "capacity":
        body = partial(_capacity_shard, num_experts=n,
                       capacity_factor=plan.experts.capacity_factor, experts=_axis(experts),
                       hidden=_axis(hidden), fused=fused)
    elif mode == "dropless":
        ragged = plan.execution.expert_exchange == "ragged_all_to_all"
        exchange = _ragged_exchange_shard if ragged and experts else _dropless_shard
        body = partial(exchange, experts=_axis(experts), hidden=_axis(hidden),
                       grouped_matmul=grouped_matmul,
                       exchange_buffer=plan.experts.exchange_buffer)
    else:
        raise ValueError(f"dispatch={mode!r} is invalid for expert parallelism: expected "
                         f"'capacity' or 'dropless'")
    tok, exp, hid = _axis(tokens), _axis(experts), _axis(hidden)
    w_in, w_out = P(exp, None, hid), P(exp, hid, None)
    # the Pallas kernels (megablox gmm, the GPU kernels) declare outputs without
    # varying-across-mesh types, which shard_map's type check refuses: they run unchecked
    # (the collectives are the same)
    fn = jax.shard_map(partial(_scoped, body), mesh=layout.mesh,
                       in_specs=(P(tok, None), P(tok, None), (w_in, w_in, w_out)),
                       out_specs=(P(tok, None, None), P(tok, None)),
                       check_vma=not (mode == "dropless"
                                      and grouped_matmul in ("gmm", "mgpu", "triton")))
    return fn(x, indices, tuple(weights))
