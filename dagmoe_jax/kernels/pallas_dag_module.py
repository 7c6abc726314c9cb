"""One DAG iteration (DAG-MoE eq. 7-11) as Pallas Mosaic kernels for TPU:
``ExecutionConfig.dag_module='pallas'``.

XLA:TPU runs an iteration as dozens of fusions, most of them passes over the [T, K, d] nodes
(the residual adds, the LayerNorm's float32 statistics and its backward, the split of the pair
projection and the concatenation of its gradients: about 31 passes a layer,
benchmarks/RESULTS.md). Here a program takes ``bt`` tokens with their K nodes through the whole
iteration in VMEM, as the Triton kernels do on a GPU (:mod:`dagmoe_jax.kernels.
triton_dag_module`, whose per-program arithmetic this follows rounding for rounding):

* forward: x = r + x/K, eq. 7's LayerNorm (float32 statistics, two passes over the rows it
  holds), eq. 8, eq. 9's four pair projections, eq. 10's messages summed over the senders,
  eq. 11's up-projection added to the carry: the nodes read once and written once;
* backward: the same recomputed, then the gradients of the carry and of x, the per-node tensors
  the weight gradients need (the LayerNorm's output, u, the messages, the pair projections' and
  u's gradients) and the program's sums of the LayerNorm's scale and bias gradients; the weight
  gradients are XLA's products over those rows.

The nodes are laid out node-major, [K, T, d]: a program's block [K, bt, d] holds each node's
rows as a [bt, d] matrix, so a sender's rows, the sum over a token's nodes and the spread of a
token's row to its nodes are leading-axis operations, where the token-major [T, K, d] would
split the 8-row tiles (K = 4). The first iteration also builds eq. 6's nodes from the gates and
the experts' outputs, and the last reads eq. 12's sum out, so neither is written outside the
kernels. The CPU suite runs both kernels in Pallas's interpreter against XLA's iteration
(tests/test_pallas_dag_module.py) and lowers them for TPU (tests/test_compile.py).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

# the arithmetic, the static description and the argument order are the Triton kernels':
# both compute the same iteration, rounding for rounding
from dagmoe_jax.kernels.triton_dag_kernels import (BACKWARD_OUTPUTS, F32, WEIGHTS, DagSpec,
                                                   DagTiles, _act, _dot, _round)
from dagmoe_jax.kernels.triton_dag_module import kernel_vjp

TOKENS_PER_PROGRAM = 128
"""Tokens a program takes (with their K nodes): [K, 128, d] blocks, a few MB of VMEM each in
float32 at d = 1,024."""

VMEM_LIMIT = 24 * 1024 * 1024
"""The kernels' scoped VMEM: the backward at 128 tokens and d = 1,024 needs 17.3 MB (its
[K, bt, .] blocks double-buffered and a dozen float32 temporaries), over Mosaic's 16 MB
default; 24 MB fits every TPU since v4 (32 MiB of VMEM)."""


def pallas_dag_unsupported(d_model: int, dag_dim: int, dtype) -> Optional[str]:
    """Why the Mosaic DAG kernels cannot take this module (None when they can): their blocks
    are whole 128-lane tiles, so d_model and d_g must be multiples of 128."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float32):
        return f"the Pallas DAG kernels take float32 or bfloat16 nodes ({jnp.dtype(dtype).name})"
    if d_model % 128 or dag_dim % 128:
        return (f"the Pallas DAG kernels need d_model and d_g multiples of 128 (got {d_model} "
                f"and {dag_dim})")
    return None


def _tokens(spec: DagSpec) -> int:
    """The tokens a program takes (its ``tiles.rows`` node rows, K per token)."""
    return spec.tiles.rows // spec.k


def _pairs(k: int, edges: str):
    """The (receiver i, sender j) pairs of eq. 10."""
    if edges == "self":
        return [(i, i) for i in range(k)]
    return [(i, j) for i in range(k) for j in range(k) if edges == "all" or j <= i]


class _Block:
    """A program's view: its refs by name, the K nodes' rows as lists of [bt, .] matrices."""

    def __init__(self, spec: DagSpec, refs: dict):
        self.spec, self.refs = spec, refs

    def carry(self, j):
        """r_j^{l-1} [bt, d]: read, or g_j E_j(x) (eq. 6) in the first iteration."""
        if self.spec.first:
            gate = self.refs["gates"][j].astype(F32)                          # [bt, 1]
            return _round(gate * self.refs["expert_out"][j].astype(F32), self.spec.dtype)
        return self.refs["updates"][j].astype(F32)

    def messages(self, ln_ref=None, u_ref=None, msg_ref=None):
        """Eq. 7-10 for the block: (carries, x_hat, rstd, u, parts, messages), each a list
        over the K nodes; the LayerNorm's output, u and the messages written to the refs."""
        spec, dtype = self.spec, self.spec.dtype
        residual = self.refs["x"][...].astype(F32) / spec.k                  # exact, K = 2^n
        scale, bias = self.refs["ln_scale"][...], self.refs["ln_bias"][...]  # [1, d] float32
        carries, xhats, rstds, us, parts = [], [], [], [], []
        for j in range(spec.k):
            carry = self.carry(j)
            node = _round(carry + residual, dtype)
            mean = jnp.mean(node, axis=1, keepdims=True)
            centred = node - mean
            rstd = lax.rsqrt(jnp.mean(centred * centred, axis=1, keepdims=True) + spec.eps)
            xhat = centred * rstd
            ln = _round(xhat * scale + bias, dtype)                                  # eq. 7
            u = _round(_dot(ln, self.refs["w_down"][...], dtype), dtype)            # eq. 8
            proj = _round(_dot(u, self.refs["w_pair"][...], dtype), dtype)          # eq. 9
            g = spec.g
            parts.append(tuple(proj[:, q * g:(q + 1) * g] for q in range(4)))
            carries.append(carry), xhats.append(xhat), rstds.append(rstd), us.append(u)
            if ln_ref is not None:
                ln_ref[j] = ln.astype(ln_ref.dtype)
                u_ref[j] = u.astype(u_ref.dtype)
        msgs = [jnp.zeros((_tokens(spec), spec.g), F32) for _ in range(spec.k)]
        for i, j in _pairs(spec.k, spec.edges):                                     # eq. 10
            e_i, n_i, _, _ = parts[i]
            _, _, e_j, n_j = parts[j]
            msgs[i] = msgs[i] + _act(e_i + e_j, spec.edge_act)[0] * (n_i + n_j)
        msgs = [_round(m, dtype) for m in msgs]
        if msg_ref is not None:
            for j in range(spec.k):
                msg_ref[j] = msgs[j].astype(msg_ref.dtype)
        return carries, xhats, rstds, us, parts, msgs


def forward_kernel(*refs, spec: DagSpec):
    """r^l = r^{l-1} + W_up sum_j m_(i,j) (eq. 7-11) for the block's nodes; in the last
    iteration sum_i r_i^l per token (eq. 12)."""
    names = spec.sources + WEIGHTS
    block = _Block(spec, dict(zip(names, refs)))
    out_ref = refs[len(names)]
    carries, _, _, _, _, msgs = block.messages()
    total = None
    for j in range(spec.k):
        update = _round(_dot(msgs[j], block.refs["w_up"][...], spec.dtype), spec.dtype)
        new = _round(carries[j] + update, spec.dtype)                              # eq. 11
        if spec.last:
            total = new if total is None else total + new
        else:
            out_ref[j] = new.astype(out_ref.dtype)
    if spec.last:
        out_ref[...] = total.astype(out_ref.dtype)



def backward_kernel(*refs, spec: DagSpec):
    """The block's gradients (the module docstring): eq. 7-10 recomputed, then back through
    eq. 11, 10, 9, 8, 7 and 6."""
    names = spec.sources + WEIGHTS + ("d_out",)
    block = _Block(spec, dict(zip(names, refs)))
    out = dict(zip(spec.sources + BACKWARD_OUTPUTS, refs[len(names):]))
    dtype, g, d = spec.dtype, spec.g, spec.d
    carries, xhats, rstds, _, parts, msgs = block.messages(out["ln"], out["u"], out["msg"])
    if spec.last:
        d_last = block.refs["d_out"][...].astype(F32)                  # every node alike
    d_new = [d_last if spec.last else block.refs["d_out"][j].astype(F32)
             for j in range(spec.k)]
    d_msg = [_round(_dot(dn, block.refs["w_up"][...], dtype, True), dtype) for dn in d_new]
    d_parts = [[jnp.zeros((_tokens(spec), g), F32) for _ in range(4)] for _ in range(spec.k)]
    for i, j in _pairs(spec.k, spec.edges):                          # eq. 10's gradients
        e_i, n_i, _, _ = parts[i]
        _, _, e_j, n_j = parts[j]
        gate, slope = _act(e_i + e_j, spec.edge_act)
        d_pre, d_n = d_msg[i] * (n_i + n_j) * slope, d_msg[i] * gate
        d_parts[i][0] = d_parts[i][0] + d_pre
        d_parts[i][1] = d_parts[i][1] + d_n
        d_parts[j][2] = d_parts[j][2] + d_pre
        d_parts[j][3] = d_parts[j][3] + d_n
    scale = block.refs["ln_scale"][...]
    d_scale = jnp.zeros((1, d), F32)
    d_bias = jnp.zeros((1, d), F32)
    d_residual = None
    for j in range(spec.k):
        d_proj = jnp.concatenate([_round(p, dtype) for p in d_parts[j]], axis=1)
        out["d_proj"][j] = d_proj.astype(out["d_proj"].dtype)
        d_u = _round(_dot(d_proj, block.refs["w_pair"][...], dtype, True), dtype)   # eq. 9
        out["d_u"][j] = d_u.astype(out["d_u"].dtype)
        dy = _round(_dot(d_u, block.refs["w_down"][...], dtype, True), dtype)       # eq. 8
        xhat, rstd = xhats[j], rstds[j]
        d_scale = d_scale + jnp.sum(dy * xhat, axis=0, keepdims=True)
        d_bias = d_bias + jnp.sum(dy, axis=0, keepdims=True)
        gy = dy * scale                                                              # eq. 7
        dx = _round(rstd * (gy - jnp.mean(gy, axis=1, keepdims=True)
                            - xhat * jnp.mean(gy * xhat, axis=1, keepdims=True)), dtype)
        d_carry = _round(d_new[j] + dx, dtype)                     # r^{l-1}'s gradient
        if spec.first:                                             # eq. 6: r^0 = g E(x)
            gate = block.refs["gates"][j].astype(F32)
            expert_out = block.refs["expert_out"][j].astype(F32)
            out["expert_out"][j] = (gate * d_carry).astype(out["expert_out"].dtype)
            out["gates"][j] = jnp.sum(expert_out * d_carry, axis=1, keepdims=True).astype(
                out["gates"].dtype)
        else:
            out["updates"][j] = d_carry.astype(out["updates"].dtype)
        d_residual = dx if d_residual is None else d_residual + dx
    out["x"][...] = (_round(d_residual, dtype) / spec.k).astype(out["x"].dtype)   # x / K
    out["d_scale"][0] = d_scale
    out["d_bias"][0] = d_bias


# ---------------------------------------------------------------------- the calls and the VJP

def _node_spec(spec: DagSpec, width: int):
    from jax.experimental import pallas as pl
    return pl.BlockSpec((spec.k, _tokens(spec), width), lambda t: (0, t, 0))


def _token_spec(spec: DagSpec, width: int):
    from jax.experimental import pallas as pl
    return pl.BlockSpec((_tokens(spec), width), lambda t: (t, 0))


def _whole(shape):
    from jax.experimental import pallas as pl
    return pl.BlockSpec(shape, lambda t: (0,) * len(shape))


def _call(kernel, args, in_specs, out_shape, out_specs, programs: int, spec: DagSpec,
          name: str, flops: float):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    nbytes = sum(a.size * a.dtype.itemsize for a in args) + sum(
        s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(out_shape))
    # inside a shard_map the outputs vary over the manual axes the nodes do
    varying = jax.typeof(args[0]).mat
    out_shape = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=varying), out_shape)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(programs,), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=0,
                                      bytes_accessed=int(nbytes)),
        interpret=spec.interpret, name=name)(*args)


def _source_specs(spec: DagSpec):
    return ((_node_spec(spec, 1), _node_spec(spec, spec.d)) if spec.first
            else (_node_spec(spec, spec.d),))


def _weight_specs(spec: DagSpec):
    d, g = spec.d, spec.g
    return (_token_spec(spec, d), _whole((1, d)), _whole((1, d)), _whole((d, g)),
            _whole((g, 4 * g)), _whole((g, d)))


def _flops(spec: DagSpec, tokens: int, backward: bool) -> float:
    """Eq. 8, 9 and 11's products, 2 R (2 d d_g + 4 d_g^2) for R = K T node rows; the
    backward recomputes eq. 8-9 and runs the input gradients of eq. 11, 9 and 8:
    2 R (3 d d_g + 8 d_g^2)."""
    rows, d, g = spec.k * tokens, spec.d, spec.g
    return 2.0 * rows * ((3 * d * g + 8 * g * g) if backward else (2 * d * g + 4 * g * g))


def _forward(spec: DagSpec, *args):
    tokens = args[len(spec.sources)].shape[0]
    shape = (tokens, spec.d) if spec.last else (spec.k, tokens, spec.d)
    out_spec = _token_spec(spec, spec.d) if spec.last else _node_spec(spec, spec.d)
    return _call(functools.partial(forward_kernel, spec=spec), args,
                 _source_specs(spec) + _weight_specs(spec),
                 jax.ShapeDtypeStruct(shape, spec.dtype), out_spec, tokens // _tokens(spec),
                 spec, "dagmoe_pallas_dag_forward", _flops(spec, tokens, False))


def _backward(spec: DagSpec, saved, d_out):
    sources, x, weights = saved[:len(spec.sources)], saved[len(spec.sources)], saved[-5:]
    ln_scale, ln_bias, w_down, w_pair, w_up = weights
    tokens, (d, g, k, dtype) = x.shape[0], (spec.d, spec.g, spec.k, spec.dtype)
    programs = tokens // _tokens(spec)
    node = lambda width: jax.ShapeDtypeStruct((k, tokens, width), dtype)  # noqa: E731
    source_shapes = (node(1), node(d)) if spec.first else (node(d),)
    out_shape = source_shapes + (
        jax.ShapeDtypeStruct((tokens, d), dtype), node(d), node(g), node(g), node(4 * g),
        node(g), jax.ShapeDtypeStruct((programs, 1, d), F32),
        jax.ShapeDtypeStruct((programs, 1, d), F32))
    from jax.experimental import pallas as pl
    partial_spec = pl.BlockSpec((1, 1, d), lambda t: (t, 0, 0))
    out_specs = _source_specs(spec) + (
        _token_spec(spec, d), _node_spec(spec, d), _node_spec(spec, g), _node_spec(spec, g),
        _node_spec(spec, 4 * g), _node_spec(spec, g), partial_spec, partial_spec)
    d_out_spec = _token_spec(spec, d) if spec.last else _node_spec(spec, d)
    outs = _call(functools.partial(backward_kernel, spec=spec), saved + (d_out,),
                 _source_specs(spec) + _weight_specs(spec) + (d_out_spec,), out_shape,
                 out_specs, programs, spec, "dagmoe_pallas_dag_backward",
                 _flops(spec, tokens, True))
    n = len(spec.sources)
    d_sources, (d_x, ln, u, msg, d_proj, d_u, d_scale, d_bias) = outs[:n], outs[n:]

    def weight_grad(eq, a, b, like):                     # over the node rows, XLA's product
        return jnp.einsum(eq, a, b, preferred_element_type=F32).astype(like.dtype)

    if spec.last:      # the update reaches every node of a token alike: the messages summed
        d_up = weight_grad("tg,td->gd", jnp.sum(msg, axis=0, dtype=F32).astype(dtype), d_out,
                           w_up)
    else:
        d_up = weight_grad("ktg,ktd->gd", msg, d_out, w_up)
    return tuple(d_sources) + (
        d_x, jnp.sum(d_scale, axis=0).astype(ln_scale.dtype),
        jnp.sum(d_bias, axis=0).astype(ln_bias.dtype),
        weight_grad("ktd,ktg->dg", ln, d_u, w_down), weight_grad("ktg,ktq->gq", u, d_proj,
                                                                 w_pair), d_up)


@functools.lru_cache(maxsize=None)
def _iteration(spec: DagSpec):
    return kernel_vjp(spec, _forward, _backward)


def pallas_dag_iteration(carry, x: jax.Array, ln_scale, ln_bias, w_down, w_pair, w_up, *,
                         eps: float, edges: str = "all", edge_act: str = "silu",
                         last: bool = False, tokens_per_program: int = TOKENS_PER_PROGRAM,
                         interpret: bool = False) -> jax.Array:
    """One DAG iteration on the carried updates r^{l-1}, node-major [K, T, d] (DAG-MoE eq.
    7-11): the nodes are x^{l-1} = r^{l-1} + x/K, and r^l = r^{l-1} + W_up sum_j m_(i,j)
    [K, T, d] is returned; with ``last``, eq. 12's sum over the nodes, sum_i r_i^l [T, d].

    ``carry`` is r^{l-1} [K, T, d], or, in the first iteration, the pair (gates [K, T, 1],
    expert outputs [K, T, d]) of eq. 6, r^0 = g_i E_i(x), built in the kernel. ``x`` [T, d] is
    the block's input; ``w_pair`` [d_g, 4 d_g] is
    :func:`~dagmoe_jax.families.moe.dag.equations.dag_pair_weights`'s layout; the matrices are used
    in the nodes' dtype, the LayerNorm's scale and bias in float32. T is padded to whole
    programs here. Differentiable in every array (one ``jax.custom_vjp``); ``interpret`` runs
    the kernels in the Pallas interpreter (any backend)."""
    first = isinstance(carry, tuple)
    nodes = carry[1] if first else carry
    k, t, d = nodes.shape
    dtype = nodes.dtype
    g = w_down.shape[1]
    bt = min(tokens_per_program, -(-t // 8) * 8)
    tokens = -(-t // bt) * bt
    pad = lambda a, axis: a if tokens == t else jnp.pad(  # noqa: E731
        a, [(0, tokens - t) if i == axis else (0, 0) for i in range(a.ndim)])
    spec = DagSpec(d=d, g=g, k=k, tiles=DagTiles(rows=k * bt, chunk=d),
                   dtype=jnp.dtype(dtype), eps=float(eps), edges=edges, edge_act=edge_act,
                   first=first, last=last, interpret=interpret)
    sources = (pad(carry[0].astype(dtype), 1), pad(nodes, 1)) if first else (pad(nodes, 1),)
    out = _iteration(spec)(*sources, pad(x.astype(dtype), 0),
                           ln_scale.astype(F32).reshape(1, d), ln_bias.astype(F32).reshape(1, d),
                           w_down.astype(dtype), w_pair.astype(dtype), w_up.astype(dtype))
    return out[:t] if last else out[:, :t]
