"""Grouped matmuls for NVIDIA GPUs: dropless dispatch's GEMMs without XLA's dense rewrite.

Each is ``jax.lax.ragged_dot(lhs, rhs, sizes)``: the rows of ``lhs`` [M, K] are sorted by
group, group g's ``sizes[g]`` rows are multiplied by ``rhs[g]`` [K, N], rows past
``sum(sizes)`` (the padding of expert-parallel receive buffers) give zeros and no gradient.
XLA:GPU rewrites ``ragged_dot`` into a dense dot over zero-padded groups (E times the FLOPs and
an [E, M, N]-sized temporary); these run one tiled GEMM over the groups instead, forward,
input gradient and weight gradient tied together by one ``jax.custom_vjp``
(:func:`~dagmoe_jax.kernels.grouped_vjp.grouped_vjp`):

* :func:`mgpu_grouped_matmul` (:mod:`.mgpu_grouped_matmul`,
  ``ExecutionConfig.grouped_matmul='mgpu'``, Hopper sm90): JAX's in-tree Mosaic GPU kernels,
  ``ragged_dot_mgpu.ragged_dot`` for the forward and (with ``transpose_rhs``) the input
  gradient, ``transposed_ragged_dot_mgpu.transposed_ragged_dot`` for the weight gradient:
  warpgroup MMAs fed by TMA, a persistent grid of one program per SM.
* :func:`triton_grouped_matmul` (:mod:`.triton_grouped_matmul`, ``'triton'``, Ampere sm80
  and newer): a Pallas Triton kernel of this library's, the design card's A100 path.

Both take 16-bit operands on a GPU (``'triton'`` also float32) and dims that their tiles divide
(:func:`mgpu_unsupported`, :func:`triton_unsupported` say why not), and both run anywhere in
their interpreters (``interpret=True``), which is how the CPU suite checks them against
``ragged_dot`` (tests/test_gpu_grouped_matmul.py). Which one a model uses is settled once by
:func:`dagmoe_jax.model.settle.settle`; nothing here asks which machine it runs on.

The block sizes (:func:`mgpu_blocks`, :func:`triton_blocks`) are a small table per shape,
timed on an H200 by ``benchmarks/gpu_check.py`` at MoE-l's expert shape (benchmarks/RESULTS.md,
"On an accelerator"): for Mosaic GPU 64 x 256 output tiles for the forward and 128-deep weight
gradients, the fastest of the tiles timed (ahead of the kernels' own 128 x 128 defaults and
far ahead of ``ragged_dot``'s dense rewrite); for Triton its standard GEMM tiles (128 x 128 x
64, 8 warps, 3 stages), which were already the fastest.
"""

from __future__ import annotations

from dagmoe_jax.kernels.mgpu_grouped_matmul import (H100_SMS, MGPU_DIM, MgpuBlocks,
                                                    mgpu_blocks, mgpu_grouped_matmul,
                                                    mgpu_unsupported, mgpu_weight_blocks,
                                                    mosaic_gpu_target)
from dagmoe_jax.kernels.triton_grouped_matmul import (TRITON_DIM, TritonBlocks, triton_blocks,
                                                      triton_grouped_matmul, triton_unsupported,
                                                      triton_weight_blocks)

__all__ = ["H100_SMS", "MGPU_DIM", "MgpuBlocks", "TRITON_DIM", "TritonBlocks", "mgpu_blocks",
           "mgpu_grouped_matmul", "mgpu_unsupported", "mgpu_weight_blocks", "mosaic_gpu_target",
           "triton_blocks", "triton_grouped_matmul", "triton_unsupported",
           "triton_weight_blocks"]
