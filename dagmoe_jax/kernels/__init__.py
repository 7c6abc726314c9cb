"""Kernels beyond what XLA emits on its own, one module per machine they are written for.

* CPU, :mod:`.attention`: a fused causal grouped-query attention in C++ (an XLA FFI custom
  call, compiled on first use and cached on disk by :mod:`.build`): what
  ``ExecutionConfig.attention='auto'`` settles to on CPU for float32 when a C++ compiler is
  available ('fused'); :mod:`.grouped_matmul`, dropless dispatch's grouped matmul in C++ (one
  GEMM per expert group, forward and both gradients, built and cached the same way): what
  ``ExecutionConfig.grouped_matmul='auto'`` settles to on CPU off-mesh ('cpu_gmm'), and in the
  same C++ file a dense layer's weight gradient (``cpu_dense_matmul``, ``cpu_weight_gradient``),
  which the DAG module's projections use on CPU;
  :mod:`.dag_module`, the DAG module's LayerNorm and pairwise messages in C++ (the messages
  without the K x K pair tensor): what ``ExecutionConfig.dag_module='auto'`` settles to on CPU
  for float32 off-mesh ('fused').
* TPU, :mod:`.pallas`: JAX's Pallas TPU kernels wrapped for this model's layouts, the splash
  attention (``attention='splash'``) and megablox's grouped matmul for dropless dispatch
  (``grouped_matmul='gmm'``); :mod:`.pallas_dag_module`, a whole DAG iteration (eq. 7-11) as
  one Pallas Mosaic kernel forward and one backward on node-major [K, T, d] nodes
  (``dag_module='pallas'``, d and d_g multiples of 128; only when asked for: no TPU has
  measured it). They run
  anywhere in the Pallas interpreter, which is how the CPU tests check them.

* GPU, :mod:`.gpu_grouped_matmul`: dropless dispatch's grouped matmul without XLA:GPU's dense
  rewrite of ``ragged_dot``: JAX's Mosaic GPU kernels on Hopper (:mod:`.mgpu_grouped_matmul`,
  ``grouped_matmul='mgpu'``) and a Pallas Triton kernel of ours on Ampere and newer
  (:mod:`.triton_grouped_matmul`, ``'triton'``), each a custom VJP over forward, input and
  weight gradient (:mod:`.grouped_vjp`); both run in their interpreters on CPU, which is how
  the tests check them; :mod:`.triton_dag_module`, a whole DAG iteration (eq. 7-11) as one
  Pallas Triton kernel forward and one backward (``dag_module='triton'``, sm80+; 3.3x slower
  than XLA's iteration on an H200, so not 'auto''s choice). Attention on
  GPU is cuDNN's ('cudnn'), JAX's Triton flash kernel (:mod:`.gpu_attention`) or XLA's.
"""

from dagmoe_jax.kernels.attention import (SUPPORTED_HEAD_DIMS, fused_attention_unavailable,
                                          fused_causal_attention)

from dagmoe_jax.kernels.dag_module import (dag_module_unavailable, fused_dag_messages,
                                           fused_layer_norm)
from dagmoe_jax.kernels.grouped_matmul import (cpu_dense_matmul, cpu_grouped_matmul,
                                               cpu_weight_gradient, grouped_matmul_unavailable)

__all__ = ["SUPPORTED_HEAD_DIMS", "cpu_dense_matmul", "cpu_grouped_matmul",
           "cpu_weight_gradient", "dag_module_unavailable",
           "fused_attention_unavailable", "fused_causal_attention", "fused_dag_messages",
           "fused_layer_norm", "grouped_matmul_unavailable"]
