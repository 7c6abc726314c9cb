"""The bodies of the DAG iteration's Pallas Triton kernels
(:mod:`dagmoe_jax.kernels.triton_dag_module` calls them and ties them into one VJP): what a
program computes on its tile of node rows, forward (:func:`forward_kernel`) and backward
(:func:`backward_kernel`), in plain ``jnp`` on the values it holds, so that the same code runs
in Triton and in Pallas's interpreter."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class DagTiles:
    """A program's ``rows`` node rows (``rows / K`` whole tokens), the model dimension in
    ``chunk``-wide column steps, ``num_warps`` warps."""

    rows: int = 32
    chunk: int = 64
    num_warps: int = 8


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


@dataclasses.dataclass(frozen=True)
class DagSpec:
    """What a kernel computes (static): the shapes, the dtype, the options of eq. 7-10, and
    whether the iteration is the first (the carry r^0 = g E(x) built from the gates and the
    experts' outputs, eq. 6) and the last (the nodes summed, eq. 12)."""

    d: int
    g: int
    k: int
    tiles: DagTiles
    dtype: object
    eps: float
    edges: str
    edge_act: str
    first: bool
    last: bool
    interpret: bool = False

    @property
    def sources(self) -> tuple:
        """The names of the arrays the carry is read from."""
        return ("gates", "expert_out") if self.first else ("updates",)


class _Tile:
    """One program's ``rows`` node rows (``bt`` tokens): its refs by name, its offsets, and the
    arrays of eq. 6-7 a column chunk at a time."""

    def __init__(self, spec: DagSpec, refs: dict):
        from jax.experimental import pallas as pl
        self.spec, self.refs = spec, refs
        self.rows, self.bt, self.cw = spec.tiles.rows, spec.tiles.rows // spec.k, spec.tiles.chunk
        t = pl.program_id(0)
        self.program = t
        self.here = pl.ds(t * self.rows, self.rows)
        self.tokens = pl.ds(t * self.bt, self.bt)

    def cols(self, c):
        from jax.experimental import pallas as pl
        return pl.ds(c * self.cw, self.cw)

    def gates(self):
        """g_i [rows, 1] in the carry's dtype (first iteration)."""
        return self.refs["gates"][self.here].astype(F32)[:, None]

    def carry(self, c):
        """r^{l-1} [rows, chunk]: read, or g_i E_i(x) (eq. 6) in the first iteration."""
        if self.spec.first:
            out = self.refs["expert_out"][self.here, self.cols(c)].astype(F32)
            return _round(self.gates() * out, self.spec.dtype)
        return self.refs["updates"][self.here, self.cols(c)].astype(F32)

    def spread(self, per_token):
        """[tokens, chunk] -> [rows, chunk]: each token's row for each of its K nodes."""
        k = self.spec.k
        return jnp.broadcast_to(per_token[:, None, :], (self.bt, k, self.cw)).reshape(
            self.rows, self.cw)

    def per_token(self, per_row):
        """[rows, chunk] -> [tokens, chunk]: the sum over each token's K nodes."""
        return jnp.sum(per_row.reshape(self.bt, self.spec.k, self.cw), axis=1)

    def nodes(self, c):
        """x^{l-1} = r^{l-1} + x / K [rows, chunk] (K a power of two: x / K is exact)."""
        x = self.refs["x"][self.tokens, self.cols(c)].astype(F32)
        return _round(self.carry(c) + self.spread(x / self.spec.k), self.spec.dtype)

    def stats(self):
        """Eq. 7's statistics: mean and 1/sqrt(var + eps) [rows, 1], the chunks' means and
        squared deviations merged by Chan's rule (no E[x^2] - E[x]^2 cancellation)."""
        cw, d = self.cw, self.spec.d

        def merge(c, carry):
            n, mean, m2 = carry
            x = self.nodes(c)
            mean_c = jnp.sum(x, axis=1, keepdims=True) / cw
            m2_c = jnp.sum(jnp.square(x - mean_c), axis=1, keepdims=True)
            total = n + cw
            delta = mean_c - mean
            return (total, mean + delta * (cw / total),
                    m2 + m2_c + jnp.square(delta) * (n * cw / total))

        zero = jnp.zeros((self.rows, 1), F32)
        _, mean, m2 = lax.fori_loop(0, d // cw, merge, (jnp.float32(0.0), zero, zero))
        return mean, lax.rsqrt(m2 / d + self.spec.eps)

    def normalised(self, c, mean, rstd):
        """(x_hat, LN(x) rounded to the dtype) of a column chunk (eq. 7)."""
        xhat = (self.nodes(c) - mean) * rstd
        scale = self.refs["ln_scale"][self.cols(c)].astype(F32)
        bias = self.refs["ln_bias"][self.cols(c)].astype(F32)
        return xhat, _round(xhat * scale[None, :] + bias[None, :], self.spec.dtype)

    def down(self, mean, rstd, ln_ref=None):
        """Eq. 8: u = LN(x) W_down [rows, d_g] (rounded), LN(x) written to ``ln_ref``."""
        spec = self.spec

        def step(c, acc):
            _, ln = self.normalised(c, mean, rstd)
            if ln_ref is not None:
                ln_ref[self.here, self.cols(c)] = ln.astype(ln_ref.dtype)
            return acc + _dot(ln, self.refs["w_down"][self.cols(c), :], spec.dtype)

        acc = lax.fori_loop(0, spec.d // self.cw, step, jnp.zeros((self.rows, spec.g), F32))
        return _round(acc, spec.dtype)


def _pair_cols(q: int, g: int):
    from jax.experimental import pallas as pl
    return pl.ds(q * g, g)


def _pair_block(wp_ref, q: int, g: int):
    """The q-th [d_g, d_g] block of the pair weights [W_edge,a | W_node,a | W_edge,b |
    W_node,b] (:func:`~dagmoe_jax.families.moe.dag.equations.dag_pair_weights`)."""
    return wp_ref[:, _pair_cols(q, g)]


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


def _iteration_messages(tile: _Tile, ln_ref=None):
    """Eq. 7-10 for the program's rows: (u, (e_i, n_i, e_j, n_j) as [tokens, K, d_g],
    messages [rows, d_g], mean, rstd)."""
    spec = tile.spec
    mean, rstd = tile.stats()
    u = tile.down(mean, rstd, ln_ref)
    parts = tuple(p.reshape(tile.bt, spec.k, spec.g)
                  for p in _pair_projections(u, tile.refs["w_pair"], spec.g, spec.dtype))
    msg = _messages(*parts, spec.k, spec.edges, spec.edge_act)
    return u, parts, _round(msg.reshape(tile.rows, spec.g), spec.dtype), mean, rstd


# -------------------------------------------------------------------------------- the kernels

WEIGHTS = ("x", "ln_scale", "ln_bias", "w_down", "w_pair", "w_up")
"""The kernels' inputs after the carry's sources, in order."""


def forward_kernel(*refs, spec: DagSpec):
    """One program's rows: r^l = r^{l-1} + W_up sum_j m_(i,j) (eq. 7-11); in the last
    iteration sum_i r_i^l per token (eq. 12's readout)."""
    names = spec.sources + WEIGHTS
    tile = _Tile(spec, dict(zip(names, refs)))
    out_ref = refs[len(names)]
    _, _, msg, _, _ = _iteration_messages(tile)

    def write(c, _):
        update = _round(_dot(msg, tile.refs["w_up"][:, tile.cols(c)], spec.dtype), spec.dtype)
        new = _round(tile.carry(c) + update, spec.dtype)                          # eq. 11
        if spec.last:
            out_ref[tile.tokens, tile.cols(c)] = tile.per_token(new).astype(out_ref.dtype)
        else:
            out_ref[tile.here, tile.cols(c)] = new.astype(out_ref.dtype)
        return _

    lax.fori_loop(0, spec.d // tile.cw, write, jnp.int32(0))


BACKWARD_OUTPUTS = ("x", "ln", "u", "msg", "d_proj", "d_u", "d_scale", "d_bias")
"""The backward kernel's outputs after the carry's sources' gradients, in order (``x``: its
gradient)."""


def backward_kernel(*refs, spec: DagSpec):
    """One program's rows, backward: recompute eq. 7-10, then the gradients (module doc)."""
    names = spec.sources + WEIGHTS + ("d_out",)
    tile = _Tile(spec, dict(zip(names, refs)))
    out = dict(zip(spec.sources + BACKWARD_OUTPUTS, refs[len(names):]))
    rows, g, k, dtype = tile.rows, spec.g, spec.k, spec.dtype
    u, parts, msg, mean, rstd = _iteration_messages(tile, ln_ref=out["ln"])
    out["u"][tile.here, :] = u.astype(out["u"].dtype)
    out["msg"][tile.here, :] = msg.astype(out["msg"].dtype)

    def d_out(c):                                     # the carry r^l's gradient [rows, chunk]
        if spec.last:                                 # eq. 12: every node gets the token's
            return tile.spread(tile.refs["d_out"][tile.tokens, tile.cols(c)].astype(F32))
        return tile.refs["d_out"][tile.here, tile.cols(c)].astype(F32)

    def back_up(c, acc):                                       # eq. 11's input gradient
        return acc + _dot(d_out(c), tile.refs["w_up"][:, tile.cols(c)], dtype, True)

    d_msg = _round(lax.fori_loop(0, spec.d // tile.cw, back_up, jnp.zeros((rows, g), F32)),
                   dtype)
    d_parts = _messages_grad(d_msg.reshape(tile.bt, k, g), *parts, k, spec.edges,
                             spec.edge_act)
    d_u = jnp.zeros((rows, g), F32)
    for q, d_part in enumerate(d_parts):                       # eq. 9's input gradient
        d_part = _round(d_part.reshape(rows, g), dtype)
        out["d_proj"][tile.here, _pair_cols(q, g)] = d_part.astype(out["d_proj"].dtype)
        d_u = d_u + _dot(d_part, _pair_block(tile.refs["w_pair"], q, g), dtype, True)
    d_u = _round(d_u, dtype)
    out["d_u"][tile.here, :] = d_u.astype(out["d_u"].dtype)

    def d_ln(c):                                               # eq. 8's input gradient
        return _round(_dot(d_u, tile.refs["w_down"][tile.cols(c), :], dtype, True), dtype)

    def scaled(c):
        return tile.refs["ln_scale"][tile.cols(c)].astype(F32)[None, :]

    def sums(c, carry):                                        # the LayerNorm's row sums
        s_g, s_gx = carry
        xhat, _ = tile.normalised(c, mean, rstd)
        dy = d_ln(c)
        gy = dy * scaled(c)
        out["d_scale"][tile.program, tile.cols(c)] = jnp.sum(dy * xhat, axis=0)
        out["d_bias"][tile.program, tile.cols(c)] = jnp.sum(dy, axis=0)
        return (s_g + jnp.sum(gy, axis=1, keepdims=True),
                s_gx + jnp.sum(gy * xhat, axis=1, keepdims=True))

    zero = jnp.zeros((rows, 1), F32)
    s_g, s_gx = lax.fori_loop(0, spec.d // tile.cw, sums, (zero, zero))

    def inputs(c, d_gates):                                    # eq. 7's and eq. 6's
        xhat, _ = tile.normalised(c, mean, rstd)
        gy = d_ln(c) * scaled(c)
        dx = _round(rstd * (gy - s_g / spec.d - xhat * (s_gx / spec.d)), dtype)
        d_carry = _round(d_out(c) + dx, dtype)                 # r^{l-1}'s gradient
        if spec.first:                                         # r^0 = g E(x)
            expert_out = tile.refs["expert_out"][tile.here, tile.cols(c)].astype(F32)
            out["expert_out"][tile.here, tile.cols(c)] = (
                tile.gates() * d_carry).astype(out["expert_out"].dtype)
            d_gates = d_gates + jnp.sum(expert_out * d_carry, axis=1, keepdims=True)
        else:
            out["updates"][tile.here, tile.cols(c)] = d_carry.astype(out["updates"].dtype)
        d_x = _round(tile.per_token(dx), dtype) / k            # through x / K
        out["x"][tile.tokens, tile.cols(c)] = d_x.astype(out["x"].dtype)
        return d_gates

    d_gates = lax.fori_loop(0, spec.d // tile.cw, inputs, zero)
    if spec.first:
        out["gates"][tile.here] = d_gates.reshape(rows).astype(out["gates"].dtype)
