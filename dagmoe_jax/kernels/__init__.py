"""Kernels beyond what XLA emits on its own, one module per machine they are written for.

* CPU, :mod:`.attention`: a fused causal grouped-query attention in C++ (an XLA FFI custom
  call, compiled on first use and cached on disk by :mod:`.build`): what
  ``ExecutionConfig.attention='auto'`` settles to on CPU for float32 when a C++ compiler is
  available ('fused'); :mod:`.grouped_matmul`, dropless dispatch's grouped matmul in C++ (one
  GEMM per expert group, forward and both gradients, built and cached the same way): what
  ``ExecutionConfig.grouped_matmul='auto'`` settles to on CPU off-mesh ('cpu_gmm').
* TPU, :mod:`.pallas`: JAX's Pallas TPU kernels wrapped for this model's layouts, the splash
  attention (``attention='splash'``) and megablox's grouped matmul for dropless dispatch
  (``grouped_matmul='gmm'``); they run anywhere in the Pallas interpreter, which is how the CPU
  tests check them.

GPUs need no kernel of ours: there :mod:`dagmoe_jax.run.settle` picks cuDNN's attention
('cudnn', for 16-bit compute and the head sizes cuDNN takes; XLA's otherwise) and
``jax.lax.ragged_dot`` for the grouped matmul (cuDNN's grouped GEMM with scripts/gpu_env.sh).
"""

from dagmoe_jax.kernels.attention import (SUPPORTED_HEAD_DIMS, fused_attention_unavailable,
                                          fused_causal_attention)

from dagmoe_jax.kernels.grouped_matmul import cpu_grouped_matmul, grouped_matmul_unavailable

__all__ = ["SUPPORTED_HEAD_DIMS", "cpu_grouped_matmul", "fused_attention_unavailable",
           "fused_causal_attention", "grouped_matmul_unavailable"]
