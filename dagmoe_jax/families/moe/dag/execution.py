"""How the DAG module runs: one strategy per ``ExecutionConfig.dag_module``, chosen once when
the module is built (:func:`dag_execution`), so that the equations
(:mod:`dagmoe_jax.families.moe.dag.equations`, composed in :mod:`dagmoe_jax.families.moe.dag.module`) carry
no execution flags.

A strategy supplies the four operations of an iteration whose program depends on the machine:
the node rows the LayerNorm takes, the LayerNorm (eq. 7), the projections (eq. 8, 9, 11) and
the pair sum of eq. 10; and says whether the L-th iteration is computed together with the
readout (eq. 12). A strategy whose kernels run whole iterations supplies ``aggregate``, the
module from eq. 6 to eq. 12, instead. Every strategy computes the same function
(tests/test_dag.py runs each against the NumPy transcription of the paper;
tests/test_triton_dag_module.py the Triton kernels, interpreted):

=============  ===========================================================================
``xla``        XLA on the node rows as one [T*K, .] matrix: on CPU and GPU that reshape is
               free, and with the node axis kept XLA:CPU runs the weight gradient, a
               contraction over two axes, 1.45x slower (the XLA module, measured); the
               LayerNorm folded into W_down (:mod:`dagmoe_jax.families.moe.dag.folded`); the
               L-th iteration computed with the readout, as ``fused`` does (each step's
               effect on the compiled GPU step: benchmarks/RESULTS.md, "Compiled for a
               GPU")
``xla_rank3``  XLA with the projections as einsums on the [T, K, .] node arrays (TPU's: there
               the [T, K, d] -> [T*K, d] reshape is a copy between tiled layouts, K = 4 rows
               filling half of an 8-row tile, which the compiled DAG-MoE-l step paid at every
               projection)
``fused``      the C++ kernels of :mod:`dagmoe_jax.kernels.dag_module` (CPU, float32, one
               device): the LayerNorm, the pair sum without the [T, K, K, d_g] pair tensor,
               and the projections' weight gradients (:func:`cpu_dense_matmul`, about twice
               XLA:CPU's speed at the module's shapes); iterations 1 .. L-1 scanned and the
               L-th computed with the readout, which needs only the nodes' sum (on TPU that
               split of the loop cost temporaries a chip, benchmarks/RESULTS.md, so
               ``xla_rank3`` keeps one scan)
``triton``     each iteration, eq. 7-11 with the carry's update, as one Pallas Triton kernel
               forward and one backward (:mod:`dagmoe_jax.kernels.triton_dag_module`; NVIDIA
               GPUs sm80+, one device), the first building eq. 6's nodes, the last reading
               eq. 12's sum out: the nodes read once and written once an iteration, where
               XLA:GPU runs some forty kernels, most of them passes over [T*K, d]
``pallas``     the same on TPU: each iteration one Pallas Mosaic kernel forward and one
               backward (:mod:`dagmoe_jax.kernels.pallas_dag_module`) on the nodes laid out
               node-major, [K, T, d], each device's tokens inside a ``shard_map`` over the
               mesh axes that split them (XLA cannot partition a Mosaic kernel)
``bottleneck`` eq. 6-12 by XLA in d_g (:mod:`dagmoe_jax.families.moe.dag.bottleneck`): the experts'
               outputs projected once, every iteration on [T, K, d_g] arrays, no d-wide
               node built (a GPU's 'auto')
=============  ===========================================================================
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dagmoe_jax.kernels.dag_module import fused_dag_messages, fused_layer_norm
from dagmoe_jax.kernels.grouped_matmul import cpu_dense_matmul
from dagmoe_jax.kernels.pallas_dag_module import pallas_dag_iteration
from dagmoe_jax.kernels.triton_dag_module import triton_dag_iteration
from dagmoe_jax.families.moe.dag.bottleneck import bottleneck_dag
from dagmoe_jax.families.moe.dag.equations import dag_pair_messages, dag_pair_weights, layer_norm
from dagmoe_jax.families.moe.dag.folded import folded_norm_projection
from dagmoe_jax.parallel.state import active_row_axes


@dataclasses.dataclass(frozen=True)
class XLAExecution:
    """``dag_module='xla'``: XLA's operations on the node rows (the module docstring)."""

    # class attributes, not fields: a strategy is equal to, and hashes as, any other of its
    # class (a module's static attribute, compared when nnx splits a cloned model)
    name = "xla"
    last_with_readout = True       # the L-th iteration with the readout (module docstring)
    folds_layer_norm = True        # eq. 7-8 as one product on the raw nodes (folded.py)
    whole_module = False           # True: ``aggregate`` runs eq. 6-12 by the kernels

    def rows(self, nodes: jax.Array) -> jax.Array:
        """The nodes [T, K, d] as the LayerNorm and the down-projection take them."""
        return nodes.reshape(-1, nodes.shape[-1])

    def layer_norm(self, x, scale, bias, eps: float) -> jax.Array:
        """DAG-MoE eq. 7 (:func:`~dagmoe_jax.families.moe.dag.equations.layer_norm`)."""
        return layer_norm(x, scale, bias, eps)

    def norm_project(self, nodes, scale, bias, w_down, eps: float) -> jax.Array:
        """DAG-MoE eq. 7-8, the nodes' LayerNorm projected by W_down: folded into one product
        on the raw nodes where ``folds_layer_norm``
        (:func:`~dagmoe_jax.families.moe.dag.folded.folded_norm_projection`, which never builds the
        normalised nodes: XLA:GPU ran their float32 backward as passes over [T*K, d]), else
        as written, the LayerNorm's output and then its product with W_down."""
        rows = self.rows(nodes)
        if self.folds_layer_norm:
            return folded_norm_projection(rows, scale, bias, w_down, eps)
        return self.project(self.layer_norm(rows, scale, bias, eps), w_down)

    def matmul(self, rows: jax.Array, w: jax.Array) -> jax.Array:
        """``rows [N, a] @ w [a, b]``."""
        return rows @ w

    def project(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """``x [..., a] @ w [a, b]`` in ``x``'s dtype: the projections of eq. 8, 9 and 11."""
        w = w.astype(x.dtype)
        out = self.matmul(x.reshape(-1, x.shape[-1]), w)
        return out.reshape(*x.shape[:-1], w.shape[-1])

    def pair_sum(self, proj: jax.Array, edges: str, edge_act: str) -> jax.Array:
        """DAG-MoE eq. 10 summed over j from the projected nodes [T, K, 4 d_g]."""
        return dag_pair_messages(proj, edge_act, edges)


@dataclasses.dataclass(frozen=True)
class XLARank3Execution(XLAExecution):
    """``dag_module='xla_rank3'``: the projections on the [T, K, .] node arrays as they are,
    the LayerNorm and W_down composed as written (the TPU tables' program)."""

    name = "xla_rank3"
    last_with_readout = False      # one scan of all L: on TPU the split cost 0.6 GB a chip
    # folded on the [T, K, d] nodes the compiled DAG-MoE-l step on v5p was 205.3 against
    # 205.6 ms (benchmarks/RESULTS.md): no gain on TPU, so eq. 7-8 stay as written here
    folds_layer_norm = False

    def rows(self, nodes: jax.Array) -> jax.Array:
        return nodes

    def layer_norm(self, x, scale, bias, eps: float) -> jax.Array:
        """Eq. 7 with its statistics in one pass
        (:func:`~dagmoe_jax.families.moe.dag.equations.layer_norm_statistics`; what it saves in the
        compiled step: benchmarks/RESULTS.md)."""
        return layer_norm(x, scale, bias, eps, one_pass=True)

    def project(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum("...a,ab->...b", x, w.astype(x.dtype))


@dataclasses.dataclass(frozen=True)
class CPUKernelExecution(XLAExecution):
    """``dag_module='fused'``: the C++ kernels, and the L-th iteration with the readout."""

    name = "fused"
    last_with_readout = True
    folds_layer_norm = False       # the C++ LayerNorm, then W_down

    def layer_norm(self, x, scale, bias, eps: float) -> jax.Array:
        return fused_layer_norm(x, scale, bias, eps)

    def matmul(self, rows: jax.Array, w: jax.Array) -> jax.Array:
        return cpu_dense_matmul(rows, w)

    def pair_sum(self, proj: jax.Array, edges: str, edge_act: str) -> jax.Array:
        return fused_dag_messages(proj, edges, edge_act)


@dataclasses.dataclass(frozen=True)
class TritonExecution(XLAExecution):
    """``dag_module='triton'``: each iteration one Pallas Triton kernel forward and one
    backward (:func:`~dagmoe_jax.kernels.triton_dag_module.triton_dag_iteration`), the first
    building eq. 6's nodes and the last reading eq. 12's sum out; iterations 2 .. L-1 scanned."""

    name = "triton"
    whole_module = True
    interpret = False              # the tests' subclass runs the kernels interpreted
    kernel = staticmethod(triton_dag_iteration)     # one iteration, its carry [T, K, d]

    def first_carry(self, gates: jax.Array, expert_out: jax.Array):
        """What the first iteration's kernels build eq. 6's nodes from."""
        return gates, expert_out

    def aggregate(self, x: jax.Array, gates: jax.Array, expert_out: jax.Array, weights: dict,
                  num_iters: int, shared: bool, edges: str, edge_act: str,
                  eps: float) -> jax.Array:
        """sum_i r_i^L [T, d] for the block's input ``x`` [T, d], ``gates`` [T, K] and the
        experts' outputs [T, K, d] (eq. 6-12 but the residual's count,
        :func:`~dagmoe_jax.families.moe.dag.equations.dag_block_output`); ``weights`` by name,
        stacked [L, ...] unless ``shared``."""
        x = x.astype(expert_out.dtype)

        def iteration(carry, w, last: bool):
            return self.kernel(
                carry, x, w["ln_scale"], w["ln_bias"], w["w_down"],
                dag_pair_weights(w["w_edge"], w["w_node"]), w["w_up"], eps=eps, edges=edges,
                edge_act=edge_act, last=last, interpret=self.interpret)

        def at(l):
            return weights if shared else {n: w[l] for n, w in weights.items()}

        first = self.first_carry(gates, expert_out)
        if num_iters == 1:
            return iteration(first, at(0), True)
        carry = iteration(first, at(0), False)                                  # eq. 6-11
        if num_iters > 2:
            middle = None if shared else {n: w[1:-1] for n, w in weights.items()}
            carry, _ = jax.lax.scan(
                lambda c, w: (iteration(c, weights if shared else w, False), None), carry,
                middle, length=num_iters - 2)
        return iteration(carry, at(num_iters - 1), True)                         # eq. 7-12


@dataclasses.dataclass(frozen=True)
class PallasExecution(TritonExecution):
    """``dag_module='pallas'``: each iteration one Pallas Mosaic kernel forward and one
    backward (:func:`~dagmoe_jax.kernels.pallas_dag_module.pallas_dag_iteration`) on the nodes
    node-major, [K, T, d]: the first building eq. 6's nodes, the last reading eq. 12's sum out;
    under a mesh each device runs its own tokens (a ``shard_map`` over the row axes, the
    weights' gradients summed across them by its transpose)."""

    name = "pallas"
    kernel = staticmethod(pallas_dag_iteration)     # one iteration, its carry [K, T, d]

    def first_carry(self, gates: jax.Array, expert_out: jax.Array):
        """Eq. 6's sources node-major: gates [K, T, 1], expert outputs [K, T, d]."""
        return (jnp.transpose(gates.astype(expert_out.dtype))[..., None],
                jnp.transpose(expert_out, (1, 0, 2)))

    def aggregate(self, x, gates, expert_out, weights: dict, num_iters: int, shared: bool,
                  edges: str, edge_act: str, eps: float) -> jax.Array:
        axes = active_row_axes(x.shape[0])
        run = functools.partial(super().aggregate, num_iters=num_iters, shared=shared,
                                edges=edges, edge_act=edge_act, eps=eps)
        if axes is None:
            return run(x, gates, expert_out, weights)
        rows = P(axes)

        def local(x, gates, expert_out, weights):     # the weights vary with their gradients
            weights = jax.tree.map(lambda w: jax.lax.pcast(w, axes, to="varying"), weights)
            return run(x, gates, expert_out, weights)

        return jax.shard_map(local, in_specs=(rows, rows, rows, P()), out_specs=rows)(
            x, gates, expert_out, weights)


@dataclasses.dataclass(frozen=True)
class BottleneckExecution(XLAExecution):
    """``dag_module='bottleneck'``: eq. 6-12 by XLA with the iterations in d_g
    (:func:`~dagmoe_jax.families.moe.dag.bottleneck.bottleneck_dag`): the experts' outputs projected
    once onto (2L - 1) d_g columns, no [T, K, d] node built. Recording the edge gates
    (analysis) runs the composed iteration of ``xla``."""

    name = "bottleneck"
    whole_module = True

    def aggregate(self, x, gates, expert_out, weights: dict, num_iters: int, shared: bool,
                  edges: str, edge_act: str, eps: float) -> jax.Array:
        """sum_i r_i^L [T, d], as :meth:`TritonExecution.aggregate`."""
        return bottleneck_dag(x, gates, expert_out, weights, num_iters, shared, edges,
                              edge_act, eps)


XLA = XLAExecution()
DAG_EXECUTIONS = {ex.name: ex for ex in (XLA, XLARank3Execution(), CPUKernelExecution(),
                                         TritonExecution(), PallasExecution(),
                                         BottleneckExecution())}


def dag_execution(name: str) -> XLAExecution:
    """The strategy of a settled ``ExecutionConfig.dag_module`` (``'xla'``, ``'xla_rank3'``,
    ``'fused'``, ``'triton'`` or ``'pallas'``)."""
    if name not in DAG_EXECUTIONS:
        raise ValueError(f"ExecutionConfig.dag_module={name!r} is not settled to one of "
                         f"{sorted(DAG_EXECUTIONS)}: build the model with "
                         "execution=dagmoe_jax.model.settle.settle(cfg, execution)")
    return DAG_EXECUTIONS[name]
