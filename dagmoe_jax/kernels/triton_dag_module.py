"""One DAG iteration (DAG-MoE eq. 7-11) as Pallas Triton kernels for NVIDIA GPUs (sm80+):
``ExecutionConfig.dag_module='triton'``.

XLA runs an iteration as some forty kernels, most of them passes over the [T*K, d] node rows
(the LayerNorm's float32 backward, the residual adds, the split of the pair projection and
the concatenation of its gradients: benchmarks/RESULTS.md, "Compiled for a GPU"). Here a
program takes ``rows`` node rows (``rows / K`` tokens with their K nodes) through the whole
iteration on chip:

* forward (:func:`_forward_kernel`): x = r + x/K (eq. 6's carry plus the residual), eq. 7's
  LayerNorm (statistics in float32, merged over column chunks by Chan's rule), eq. 8's
  down-projection, eq. 9's four pair projections, eq. 10's messages summed over the senders
  (a loop over the K senders, never the [T, K, K, d_g] pair tensor), eq. 11's up-projection
  added to the carry: one read of the nodes, one write;
* backward (:func:`_backward_kernel`): the same recomputed, then the gradients of the nodes and
  of the residual, the LayerNorm's output and the small per-row tensors (u, the messages, the
  pair projections' and u's gradients) the weight gradients need, and each program's partial
  sums of the LayerNorm's scale and bias gradients; the weight gradients themselves are four
  GEMMs over those rows, which XLA gives to cuBLAS (:func:`_backward`).

Every rounding the XLA program makes in a 16-bit compute dtype (the LayerNorm's output, each
projection's output, the messages, the updates) is made here at the same point, so the
kernels compute :func:`~dagmoe_jax.model.dag.module.dag_iteration`'s function, which the CPU
suite checks in Pallas's interpreter (``interpret=True``; tests/test_triton_dag_module.py).
The tiles (:class:`DagTiles`) were chosen without a GPU: none has timed them yet.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class DagTiles:
    """A program's ``rows`` node rows (``rows / K`` whole tokens), the model dimension in
    ``chunk``-wide column steps, ``num_warps`` warps."""

    rows: int = 32
    chunk: int = 64
    num_warps: int = 4


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_dag_unsupported(d_model: int, dag_dim: int, top_k: int, dtype) -> Optional[str]:
    """Why the Triton DAG kernels cannot take this module (None when they can): Triton's
    tensors have power-of-two sides, so d_g and K must be powers of two (d_g >= 16, the
    smallest dot tile) and d_model a multiple of 16."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"the Triton DAG kernels take float32 or 16-bit nodes ({jnp.dtype(dtype).name})"
    if not _power_of_two(dag_dim) or dag_dim < 16:
        return f"the Triton DAG kernels need d_g a power of two >= 16 (got {dag_dim})"
    if not _power_of_two(top_k) or top_k > 16:
        return f"the Triton DAG kernels need K (top_k) a power of two <= 16 (got {top_k})"
    if d_model % 16:
        return f"the Triton DAG kernels need d_model a multiple of 16 (got {d_model})"
    return None


def dag_tiles(d_model: int, top_k: int) -> DagTiles:
    """32 node rows a program (at least 16, Triton's smallest dot) and the widest column
    chunk of 64, 32 or 16 that divides d_model."""
    chunk = next(c for c in (64, 32, 16) if d_model % c == 0)
    return DagTiles(rows=max(32, top_k), chunk=chunk)


# ----------------------------------------------------------------------------- the arithmetic
# Helpers of the kernels' bodies: plain jnp on the values a program holds, so the same code
# runs in Triton and in the interpreter.

def _round(x, dtype):
    """``x`` rounded to ``dtype`` and held in float32 (XLA's rounding at an op's output)."""
    return x.astype(dtype).astype(F32)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _act(x, edge_act: str):
    """The edge activation of eq. 10 (SiLU or sigmoid) and its derivative."""
    s = _sigmoid(x)
    if edge_act == "silu":
        return x * s, s * (1.0 + x * (1.0 - s))
    return s, s * (1.0 - s)


def _dot(a, b, dtype, trans_b: bool = False):
    """``a @ b`` (``b^T``) of float32-held values, operands in ``dtype``, float32 out."""
    a, b = a.astype(dtype), b.astype(dtype)
    if trans_b:
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    return jnp.dot(a, b, preferred_element_type=F32)


def _nodes(upd_ref, res_ref, r0, t0, c, tiles: DagTiles, k: int, dtype):
    """x = r + x/K, a [rows, chunk] column chunk in ``dtype`` (held in float32)."""
    from jax.experimental import pallas as pl
    bt, cw = tiles.rows // k, tiles.chunk
    upd = upd_ref[pl.ds(r0, tiles.rows), pl.ds(c * cw, cw)].astype(F32)
    res = res_ref[pl.ds(t0, bt), pl.ds(c * cw, cw)].astype(F32)
    x = upd.reshape(bt, k, cw) + res[:, None, :]
    return _round(x.reshape(tiles.rows, cw), dtype)


def _stats(upd_ref, res_ref, r0, t0, d: int, tiles: DagTiles, k: int, dtype, eps: float):
    """Eq. 7's statistics of the rows: mean and 1/sqrt(var + eps) [rows, 1], the chunks'
    means and squared deviations merged by Chan's rule (no E[x^2] - E[x]^2 cancellation)."""
    cw = tiles.chunk

    def merge(c, carry):
        n, mean, m2 = carry
        x = _nodes(upd_ref, res_ref, r0, t0, c, tiles, k, dtype)
        mean_c = jnp.sum(x, axis=1, keepdims=True) / cw
        m2_c = jnp.sum(jnp.square(x - mean_c), axis=1, keepdims=True)
        total = n + cw
        delta = mean_c - mean
        return (total, mean + delta * (cw / total),
                m2 + m2_c + jnp.square(delta) * (n * cw / total))

    zero = jnp.zeros((tiles.rows, 1), F32)
    _, mean, m2 = lax.fori_loop(0, d // cw, merge, (jnp.float32(0.0), zero, zero))
    return mean, lax.rsqrt(m2 / d + eps)


def _normalised(upd_ref, res_ref, scale_ref, bias_ref, mean, rstd, r0, t0, c,
                tiles: DagTiles, k: int, dtype):
    """(x_hat, LN(x) rounded to ``dtype``) of a column chunk (eq. 7)."""
    from jax.experimental import pallas as pl
    cw = tiles.chunk
    xhat = (_nodes(upd_ref, res_ref, r0, t0, c, tiles, k, dtype) - mean) * rstd
    scale = scale_ref[pl.ds(c * cw, cw)].astype(F32)
    bias = bias_ref[pl.ds(c * cw, cw)].astype(F32)
    return xhat, _round(xhat * scale[None, :] + bias[None, :], dtype)


def _down(upd_ref, res_ref, scale_ref, bias_ref, wd_ref, mean, rstd, r0, t0, d, g,
          tiles: DagTiles, k: int, dtype, ln_ref=None):
    """Eq. 8: u = LN(x) W_down [rows, d_g] (rounded to ``dtype``), LN(x) written to
    ``ln_ref`` when given."""
    from jax.experimental import pallas as pl
    cw = tiles.chunk

    def step(c, acc):
        _, ln = _normalised(upd_ref, res_ref, scale_ref, bias_ref, mean, rstd, r0, t0, c,
                            tiles, k, dtype)
        if ln_ref is not None:
            ln_ref[pl.ds(r0, tiles.rows), pl.ds(c * cw, cw)] = ln.astype(ln_ref.dtype)
        return acc + _dot(ln, wd_ref[pl.ds(c * cw, cw), :], dtype)

    acc = lax.fori_loop(0, d // cw, step, jnp.zeros((tiles.rows, g), F32))
    return _round(acc, dtype)


def _pair_block(wp_ref, q: int, g: int):
    """The q-th [d_g, d_g] block of the pair weights [W_edge,a | W_node,a | W_edge,b |
    W_node,b] (:func:`~dagmoe_jax.model.dag.equations.dag_pair_weights`)."""
    from jax.experimental import pallas as pl
    return wp_ref[:, pl.ds(q * g, g)]


def _pair_projections(u, wp_ref, g: int, dtype):
    """Eq. 9 by halves: the receiver's and sender's edge and node projections e_i, n_i, e_j,
    n_j [rows, d_g]."""
    return tuple(_round(_dot(u, _pair_block(wp_ref, q, g), dtype), dtype) for q in range(4))


def _senders(x3, j: int, node):
    """Sender j's rows of a [tokens, K, d_g] array, [tokens, 1, d_g] (a masked sum: Triton
    cannot index a register tensor's middle axis)."""
    return jnp.sum(jnp.where(node == j, x3, 0.0), axis=1, keepdims=True)


def _messages(e_i, n_i, e_j, n_j, k: int, edges: str, edge_act: str):
    """Eq. 10 summed over the senders j, sum_j act(e_i + e_j) (n_i + n_j) [tokens, K, d_g]
    (``edges='ranked'``: j <= i; 'self': j = i)."""
    if edges == "self":
        return _act(e_i + e_j, edge_act)[0] * (n_i + n_j)
    node = lax.broadcasted_iota(jnp.int32, e_i.shape, 1)
    msg = jnp.zeros_like(e_i)
    for j in range(k):
        term = _act(e_i + _senders(e_j, j, node), edge_act)[0] * (n_i + _senders(n_j, j, node))
        msg = msg + (jnp.where(node >= j, term, 0.0) if edges == "ranked" else term)
    return msg


def _messages_grad(d_msg, e_i, n_i, e_j, n_j, k: int, edges: str, edge_act: str):
    """The gradients of :func:`_messages` with respect to e_i, n_i, e_j, n_j."""
    if edges == "self":
        gate, slope = _act(e_i + e_j, edge_act)
        d_pre, d_n = d_msg * (n_i + n_j) * slope, d_msg * gate
        return d_pre, d_n, d_pre, d_n
    node = lax.broadcasted_iota(jnp.int32, e_i.shape, 1)
    d_ei, d_ni = jnp.zeros_like(e_i), jnp.zeros_like(e_i)
    d_ej, d_nj = jnp.zeros_like(e_i), jnp.zeros_like(e_i)
    for j in range(k):
        ej, nj = _senders(e_j, j, node), _senders(n_j, j, node)
        gate, slope = _act(e_i + ej, edge_act)
        d_pre, d_n = d_msg * (n_i + nj) * slope, d_msg * gate
        if edges == "ranked":
            d_pre, d_n = (jnp.where(node >= j, d_pre, 0.0), jnp.where(node >= j, d_n, 0.0))
        d_ei, d_ni = d_ei + d_pre, d_ni + d_n
        d_ej = d_ej + jnp.where(node == j, jnp.sum(d_pre, axis=1, keepdims=True), 0.0)
        d_nj = d_nj + jnp.where(node == j, jnp.sum(d_n, axis=1, keepdims=True), 0.0)
    return d_ei, d_ni, d_ej, d_nj


def _iteration_messages(upd_ref, res_ref, scale_ref, bias_ref, wd_ref, wp_ref, r0, t0, *,
                        d, g, k, tiles, dtype, eps, edges, edge_act, ln_ref=None):
    """Eq. 7-10 for the program's rows: (u, (e_i, n_i, e_j, n_j) as [tokens, K, d_g],
    messages [rows, d_g], mean, rstd)."""
    mean, rstd = _stats(upd_ref, res_ref, r0, t0, d, tiles, k, dtype, eps)
    u = _down(upd_ref, res_ref, scale_ref, bias_ref, wd_ref, mean, rstd, r0, t0, d, g, tiles,
              k, dtype, ln_ref)
    bt = tiles.rows // k
    parts = tuple(p.reshape(bt, k, g) for p in _pair_projections(u, wp_ref, g, dtype))
    msg = _round(_messages(*parts, k, edges, edge_act).reshape(tiles.rows, g), dtype)
    return u, parts, msg, mean, rstd


# -------------------------------------------------------------------------------- the kernels

def _forward_kernel(upd_ref, res_ref, scale_ref, bias_ref, wd_ref, wp_ref, wu_ref, out_ref, *,
                    d, g, k, tiles: DagTiles, dtype, eps, edges, edge_act):
    """One program's rows: r^l = r^{l-1} + W_up sum_j m_(i,j) (eq. 7-11)."""
    from jax.experimental import pallas as pl
    t = pl.program_id(0)
    r0, t0, cw = t * tiles.rows, t * (tiles.rows // k), tiles.chunk
    _, _, msg, _, _ = _iteration_messages(
        upd_ref, res_ref, scale_ref, bias_ref, wd_ref, wp_ref, r0, t0, d=d, g=g, k=k,
        tiles=tiles, dtype=dtype, eps=eps, edges=edges, edge_act=edge_act)

    @pl.loop(0, d // cw)
    def _(c):
        cols = pl.ds(c * cw, cw)
        update = _round(_dot(msg, wu_ref[:, cols], dtype), dtype)                # eq. 11
        upd = upd_ref[pl.ds(r0, tiles.rows), cols].astype(F32)
        out_ref[pl.ds(r0, tiles.rows), cols] = (upd + update).astype(out_ref.dtype)


def _backward_kernel(upd_ref, res_ref, scale_ref, bias_ref, wd_ref, wp_ref, wu_ref, dout_ref,
                     dupd_ref, dres_ref, ln_ref, u_ref, msg_ref, dproj_ref, du_ref,
                     dscale_ref, dbias_ref, *, d, g, k, tiles: DagTiles, dtype, eps, edges,
                     edge_act):
    """One program's rows, backward: recompute eq. 7-10, then the gradients (module doc)."""
    from jax.experimental import pallas as pl
    t = pl.program_id(0)
    rows, bt, cw = tiles.rows, tiles.rows // k, tiles.chunk
    r0, t0 = t * rows, t * bt
    here = pl.ds(r0, rows)
    u, parts, msg, mean, rstd = _iteration_messages(
        upd_ref, res_ref, scale_ref, bias_ref, wd_ref, wp_ref, r0, t0, d=d, g=g, k=k,
        tiles=tiles, dtype=dtype, eps=eps, edges=edges, edge_act=edge_act, ln_ref=ln_ref)
    u_ref[here, :] = u.astype(u_ref.dtype)
    msg_ref[here, :] = msg.astype(msg_ref.dtype)

    def back_up(c, acc):                                       # eq. 11's input gradient
        cols = pl.ds(c * cw, cw)
        return acc + _dot(dout_ref[here, cols].astype(F32), wu_ref[:, cols], dtype, True)

    d_msg = _round(lax.fori_loop(0, d // cw, back_up, jnp.zeros((rows, g), F32)), dtype)
    d_parts = _messages_grad(d_msg.reshape(bt, k, g), *parts, k, edges, edge_act)
    d_u = jnp.zeros((rows, g), F32)
    for q, d_part in enumerate(d_parts):                        # eq. 9's input gradient
        d_part = _round(d_part.reshape(rows, g), dtype)
        dproj_ref[here, pl.ds(q * g, g)] = d_part.astype(dproj_ref.dtype)
        d_u = d_u + _dot(d_part, _pair_block(wp_ref, q, g), dtype, True)
    d_u = _round(d_u, dtype)
    du_ref[here, :] = d_u.astype(du_ref.dtype)

    def d_ln(c):                                               # eq. 8's input gradient
        return _round(_dot(d_u, wd_ref[pl.ds(c * cw, cw), :], dtype, True), dtype)

    def sums(c, carry):                                        # the LayerNorm's row sums
        s_g, s_gx = carry
        cols = pl.ds(c * cw, cw)
        xhat, _ = _normalised(upd_ref, res_ref, scale_ref, bias_ref, mean, rstd, r0, t0, c,
                              tiles, k, dtype)
        dy = d_ln(c)
        gy = dy * scale_ref[cols].astype(F32)[None, :]
        dscale_ref[t, cols] = jnp.sum(dy * xhat, axis=0)
        dbias_ref[t, cols] = jnp.sum(dy, axis=0)
        return (s_g + jnp.sum(gy, axis=1, keepdims=True),
                s_gx + jnp.sum(gy * xhat, axis=1, keepdims=True))

    zero = jnp.zeros((rows, 1), F32)
    s_g, s_gx = lax.fori_loop(0, d // cw, sums, (zero, zero))

    @pl.loop(0, d // cw)
    def _(c):                                                  # eq. 7's input gradient
        cols = pl.ds(c * cw, cw)
        xhat, _ = _normalised(upd_ref, res_ref, scale_ref, bias_ref, mean, rstd, r0, t0, c,
                              tiles, k, dtype)
        gy = d_ln(c) * scale_ref[cols].astype(F32)[None, :]
        dx = _round(rstd * (gy - s_g / d - xhat * (s_gx / d)), dtype)
        dout = dout_ref[here, cols].astype(F32)
        dupd_ref[here, cols] = (dout + dx).astype(dupd_ref.dtype)
        dres_ref[pl.ds(t0, bt), cols] = jnp.sum(dx.reshape(bt, k, cw), axis=1).astype(
            dres_ref.dtype)


# ---------------------------------------------------------------------- the calls and the VJP

def _call(kernel, args, out_shape, grid: int, tiles: DagTiles, interpret: bool, name: str):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(grid,),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=jax.tree.map(lambda _: pl.no_block_spec, out_shape),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name=name)(*args)


def _flat(updates, residual, tiles: DagTiles):
    """The carry as [T' K, d] rows and the residual as [T', d], T' padded to whole tiles."""
    t, k, d = updates.shape
    extra = -t % (tiles.rows // k)
    if extra:
        updates = jnp.pad(updates, ((0, extra), (0, 0), (0, 0)))
        residual = jnp.pad(residual, ((0, extra), (0, 0), (0, 0)))
    return updates.reshape(-1, d), residual.reshape(-1, d)


def _options(updates, w_down, tiles):
    t, k, d = updates.shape
    return dict(d=d, g=w_down.shape[1], k=k, tiles=tiles, dtype=updates.dtype)


def _forward(updates, residual, ln_scale, ln_bias, w_down, w_pair, w_up, *, eps, edges,
             edge_act, tiles, interpret):
    t, k, d = updates.shape
    upd, res = _flat(updates, residual, tiles)
    kernel = functools.partial(_forward_kernel, **_options(updates, w_down, tiles), eps=eps,
                               edges=edges, edge_act=edge_act)
    out = _call(kernel, (upd, res, ln_scale, ln_bias, w_down, w_pair, w_up),
                jax.ShapeDtypeStruct(upd.shape, upd.dtype), upd.shape[0] // tiles.rows,
                tiles, interpret, "dagmoe_triton_dag_forward")
    return out[:t * k].reshape(t, k, d)


def _backward(saved, d_out, *, eps, edges, edge_act, tiles, interpret):
    updates, residual, ln_scale, ln_bias, w_down, w_pair, w_up = saved
    t, k, d = updates.shape
    g, dtype = w_down.shape[1], updates.dtype
    upd, res = _flat(updates, residual, tiles)
    dout = _flat(d_out, residual, tiles)[0]
    n, programs = upd.shape[0], upd.shape[0] // tiles.rows
    kernel = functools.partial(_backward_kernel, **_options(updates, w_down, tiles), eps=eps,
                               edges=edges, edge_act=edge_act)
    shapes = [(n, d), (res.shape[0], d), (n, d), (n, g), (n, g), (n, 4 * g), (n, g)]
    out_shape = ([jax.ShapeDtypeStruct(s, dtype) for s in shapes]
                 + [jax.ShapeDtypeStruct((programs, d), F32)] * 2)
    d_upd, d_res, ln, u, msg, d_proj, d_u, d_scale, d_bias = _call(
        kernel, (upd, res, ln_scale, ln_bias, w_down, w_pair, w_up, dout), out_shape, programs,
        tiles, interpret, "dagmoe_triton_dag_backward")

    def weight_grad(a, b, like):                               # a^T b over the rows, cuBLAS
        return jnp.einsum("ra,rb->ab", a, b, preferred_element_type=F32).astype(like.dtype)

    return (d_upd[:t * k].reshape(t, k, d), d_res[:t].reshape(residual.shape),
            jnp.sum(d_scale, axis=0).astype(ln_scale.dtype),
            jnp.sum(d_bias, axis=0).astype(ln_bias.dtype),
            weight_grad(ln, d_u, w_down),
            weight_grad(u, d_proj, w_pair),
            weight_grad(msg, dout, w_up))


@functools.lru_cache(maxsize=None)
def _iteration(eps: float, edges: str, edge_act: str, tiles: DagTiles, interpret: bool):
    options = dict(eps=eps, edges=edges, edge_act=edge_act, tiles=tiles, interpret=interpret)

    @jax.custom_vjp
    def iteration(*args):
        return _forward(*args, **options)

    iteration.defvjp(lambda *args: (_forward(*args, **options), args),
                     functools.partial(_backward, **options))
    return iteration


def triton_dag_iteration(updates: jax.Array, residual: jax.Array, ln_scale, ln_bias, w_down,
                         w_pair, w_up, *, eps: float, edges: str = "all",
                         edge_act: str = "silu", tiles: Optional[DagTiles] = None,
                         interpret: bool = False) -> jax.Array:
    """One DAG iteration on the carried updates: r^l = r^{l-1} + W_up sum_j m_(i,j) for the
    nodes x^{l-1} = r^{l-1} + x/K (DAG-MoE eq. 7-11; ``updates`` [T, K, d] and ``residual``
    x/K [T, 1, d] as :class:`~dagmoe_jax.model.dag.module.DAGAggregator` carries them).

    ``w_pair`` [d_g, 4 d_g] is :func:`~dagmoe_jax.model.dag.equations.dag_pair_weights`'s
    layout; the matrices are used in the nodes' dtype, the LayerNorm's scale and bias in
    float32. Differentiable in every array (one ``jax.custom_vjp``); ``interpret`` runs the
    kernels in the Pallas interpreter (any backend)."""
    t, k, d = updates.shape
    reason = triton_dag_unsupported(d, w_down.shape[1], k, updates.dtype)
    if reason is not None:
        raise ValueError(f"{reason}; use ExecutionConfig.dag_module='xla'")
    dtype = updates.dtype
    tiles = tiles or dag_tiles(d, k)
    return _iteration(float(eps), edges, edge_act, tiles, interpret)(
        updates, residual.astype(dtype), ln_scale.astype(F32), ln_bias.astype(F32),
        w_down.astype(dtype), w_pair.astype(dtype), w_up.astype(dtype))
