"""One DAG iteration (DAG-MoE eq. 7-11) as Pallas Triton kernels for NVIDIA GPUs (sm80+):
``ExecutionConfig.dag_module='triton'``.

XLA runs an iteration as some forty kernels, most of them passes over the [T*K, d] node rows
(the LayerNorm's float32 backward, the residual adds, the split of the pair projection and
the concatenation of its gradients: benchmarks/RESULTS.md, "Compiled for a GPU"). Here a
program takes ``rows`` node rows (``rows / K`` tokens with their K nodes) through the whole
iteration on chip (the bodies: :mod:`dagmoe_jax.kernels.triton_dag_kernels`):

* forward: x = r + x/K (the carry plus eq. 6's residual), eq. 7's LayerNorm (statistics in
  float32, merged over column chunks by Chan's rule), eq. 8's down-projection, eq. 9's four
  pair projections, eq. 10's messages summed over the senders (a loop over the K senders,
  never the [T, K, K, d_g] pair tensor), eq. 11's up-projection added to the carry: one read
  of the nodes, one write;
* backward: the same recomputed, then the gradients of the carry and of x, the LayerNorm's
  output and the small per-row tensors (u, the messages, the pair projections' and u's
  gradients) the weight gradients need, and each program's partial sums of the LayerNorm's
  scale and bias gradients; the weight gradients themselves are four GEMMs over those rows,
  which XLA gives to cuBLAS (:func:`_backward`).

The first iteration's kernels also compute eq. 6's nodes, r^0 = g_i E_i(x), from the gates and
the experts' outputs, and the last one's eq. 12's readout, the nodes summed per token, so
neither [T, K, d] array (nor its gradient) is written outside the kernels.

Every rounding the XLA program makes in a 16-bit compute dtype (the LayerNorm's output, each
projection's output, the messages, the updates) is made here at the same point, so the
kernels compute :func:`~dagmoe_jax.families.moe.dag.module.dag_iteration`'s function, which the CPU
suite checks in Pallas's interpreter (``interpret=True``; tests/test_triton_dag_module.py).
The tiles (:class:`DagTiles`) were chosen without a GPU: none has timed them yet.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from dagmoe_jax.kernels.triton_dag_kernels import (F32, DagSpec, DagTiles, backward_kernel,
                                                   forward_kernel)


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


def dag_tiles(d_model: int, dag_dim: int, top_k: int) -> DagTiles:
    """8 warps; node rows a program such that rows x d_g <= 4,096 (the backward pass holds
    about a dozen [rows, d_g] float32 tensors: about 16 registers a thread each), at least 16
    (Triton's smallest dot) and K; the widest column chunk of 64, 32 or 16 that divides
    d_model."""
    chunk = next(c for c in (64, 32, 16) if d_model % c == 0)
    return DagTiles(rows=max(16, top_k, 4096 // dag_dim), chunk=chunk)


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


def _padded(a, tokens: int, k: int):
    """``a`` ([T, ...] per token, or [T * K, ...] per node when ``k``) with zero tokens
    appended up to ``tokens``."""
    rows = tokens * k
    extra = rows - a.shape[0]
    return jnp.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1)) if extra else a


def _kernel_inputs(spec: DagSpec, sources, x, tokens: int):
    """The carry's sources as node rows ([T' K, d], the gates [T' K]) and x as [T', d], T'
    padded to whole tiles."""
    rows = tuple(_padded(a.reshape(-1, *a.shape[2:]), tokens, spec.k) for a in sources)
    return rows + (_padded(x, tokens, 1),)


def _whole_tiles(t: int, spec: DagSpec) -> int:
    bt = spec.tiles.rows // spec.k
    return -(-t // bt) * bt


def _forward(spec: DagSpec, *args):
    sources, x, weights = args[:len(spec.sources)], args[len(spec.sources)], args[-5:]
    t = x.shape[0]
    tokens = _whole_tiles(t, spec)
    inputs = _kernel_inputs(spec, sources, x, tokens) + tuple(weights)
    shape = (tokens, spec.d) if spec.last else (tokens * spec.k, spec.d)
    out = _call(functools.partial(forward_kernel, spec=spec), inputs,
                jax.ShapeDtypeStruct(shape, spec.dtype), tokens * spec.k // spec.tiles.rows,
                spec.tiles, spec.interpret, "dagmoe_triton_dag_forward")
    return out[:t] if spec.last else out[:t * spec.k].reshape(t, spec.k, spec.d)


def _backward(spec: DagSpec, saved, d_out):
    sources, x, weights = saved[:len(spec.sources)], saved[len(spec.sources)], saved[-5:]
    ln_scale, ln_bias, w_down, w_pair, w_up = weights
    t, (d, g, k, dtype) = x.shape[0], (spec.d, spec.g, spec.k, spec.dtype)
    tokens = _whole_tiles(t, spec)
    n, programs = tokens * k, tokens * k // spec.tiles.rows
    d_out = _padded(d_out.reshape(-1, d), tokens, 1 if spec.last else k)
    inputs = _kernel_inputs(spec, sources, x, tokens) + tuple(weights) + (d_out,)
    shapes = {"gates": (n,), "expert_out": (n, d), "updates": (n, d)}
    out_shape = ([jax.ShapeDtypeStruct(shapes[s], dtype) for s in spec.sources]
                 + [jax.ShapeDtypeStruct(s, dtype) for s in
                    ((tokens, d), (n, d), (n, g), (n, g), (n, 4 * g), (n, g))]
                 + [jax.ShapeDtypeStruct((programs, d), F32)] * 2)
    outs = _call(functools.partial(backward_kernel, spec=spec), inputs, out_shape, programs,
                 spec.tiles, spec.interpret, "dagmoe_triton_dag_backward")
    d_sources, (d_x, ln, u, msg, d_proj, d_u, d_scale, d_bias) = (
        outs[:len(spec.sources)], outs[len(spec.sources):])

    def weight_grad(a, b, like):                               # a^T b over the rows, cuBLAS
        return jnp.einsum("ra,rb->ab", a, b, preferred_element_type=F32).astype(like.dtype)

    d_sources = tuple(ds[:t * k].reshape(src.shape) for ds, src in zip(d_sources, sources))
    return d_sources + (
        d_x[:t], jnp.sum(d_scale, axis=0).astype(ln_scale.dtype),
        jnp.sum(d_bias, axis=0).astype(ln_bias.dtype), weight_grad(ln, d_u, w_down),
        weight_grad(u, d_proj, w_pair),
        # the last iteration's update reaches every node of a token alike: its messages
        # summed per token (in the dtype) against the tokens' gradients
        weight_grad(jnp.sum(msg.reshape(tokens, k, g), axis=1, dtype=F32).astype(dtype)
                    if spec.last else msg, d_out, w_up))


def kernel_vjp(spec, forward, backward):
    """``forward(spec, *args)`` as one ``jax.custom_vjp`` whose backward is
    ``backward(spec, args, cotangent)``: the iteration's arguments are its residuals, the
    backward kernel recomputes the rest."""
    @jax.custom_vjp
    def iteration(*args):
        return forward(spec, *args)

    iteration.defvjp(lambda *args: (forward(spec, *args), args),
                     functools.partial(backward, spec))
    return iteration


@functools.lru_cache(maxsize=None)
def _iteration(spec: DagSpec):
    return kernel_vjp(spec, _forward, _backward)


def triton_dag_iteration(carry, x: jax.Array, ln_scale, ln_bias, w_down, w_pair, w_up, *,
                         eps: float, edges: str = "all", edge_act: str = "silu",
                         last: bool = False, tiles: Optional[DagTiles] = None,
                         interpret: bool = False) -> jax.Array:
    """One DAG iteration on the carried updates r^{l-1} (DAG-MoE eq. 7-11): the nodes are
    x^{l-1} = r^{l-1} + x/K, and r^l = r^{l-1} + W_up sum_j m_(i,j) [T, K, d] is returned; with
    ``last``, eq. 12's sum over the nodes, sum_i r_i^l [T, d].

    ``carry`` is r^{l-1} [T, K, d], or, in the first iteration, the pair (gates [T, K],
    expert outputs [T, K, d]) of eq. 6, r^0 = g_i E_i(x), built in the kernel. ``x`` [T, d] is
    the block's input in the nodes' dtype; ``w_pair`` [d_g, 4 d_g] is
    :func:`~dagmoe_jax.families.moe.dag.equations.dag_pair_weights`'s layout; the matrices are used
    in the nodes' dtype, the LayerNorm's scale and bias in float32. Differentiable in every
    array (one ``jax.custom_vjp``); ``interpret`` runs the kernels in the Pallas interpreter
    (any backend)."""
    first = isinstance(carry, tuple)
    nodes = carry[1] if first else carry
    t, k, d = nodes.shape
    dtype = nodes.dtype
    reason = triton_dag_unsupported(d, w_down.shape[1], k, dtype)
    if reason is not None:
        raise ValueError(f"{reason}; use ExecutionConfig.dag_module='xla'")
    g = w_down.shape[1]
    spec = DagSpec(d=d, g=g, k=k, tiles=tiles or dag_tiles(d, g, k), dtype=jnp.dtype(dtype),
                   eps=float(eps), edges=edges, edge_act=edge_act, first=first, last=last,
                   interpret=interpret)
    sources = (carry[0].astype(dtype), nodes) if first else (nodes,)
    return _iteration(spec)(*sources, x.astype(dtype), ln_scale.astype(F32),
                            ln_bias.astype(F32), w_down.astype(dtype), w_pair.astype(dtype),
                            w_up.astype(dtype))
