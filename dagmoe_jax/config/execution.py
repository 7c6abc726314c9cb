"""How the model runs on a machine, not what it computes: every choice that depends on the
backend or the mesh, in one ``ExecutionConfig`` beside the mesh (``RunConfig.execution``),
each 'auto' settled once when the run is built (:func:`dagmoe_jax.model.settle.settle`, which
returns the concrete config the model is built with: ``Transformer(cfg, execution=...)``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from dagmoe_jax.validate import (check as _check, choice as _choice,
                                 nonnegative_int as _nonnegative_int, positive as _positive)

REMAT_POLICIES = ("auto", "none", "full", "dots")
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "fused", "cudnn", "triton", "splash")
GROUPED_MATMULS = ("auto", "ragged_dot", "gmm", "cpu_gmm", "mgpu", "triton", "einsum")
EXPERT_EXCHANGES = ("auto", "all_gather", "ragged_all_to_all")
DAG_MODULES = ("auto", "xla", "xla_rank3", "fused", "triton", "pallas", "bottleneck")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs on a machine, not what it computes (``RunConfig.execution``).

    Changing any of these changes neither the parameters nor, beyond floating-point rounding,
    the outputs, so a run may resume with them changed (on another machine, say). Each 'auto'
    is settled and printed once, when the run is built (:mod:`dagmoe_jax.model.settle`).

    remat: 'auto' (default: 'none' on CPU, 'full' on GPU / TPU), 'full' (recompute each layer
      in the backward pass; MaxText's default, for accelerator memory), 'dots' (save matmul
      outputs only) or 'none' (store every activation).
    scan_unroll: layers per iteration of the scanned layer loop (``jax.lax.scan``'s unroll);
      0 (default) means auto: the whole stack unrolled on CPU, 1 (one compiled layer body)
      elsewhere. The parameters stay stacked [layers, ...] either way.
    attention: 'auto' (on CPU: the fused C++ kernel for float32 off-mesh when a C++ compiler
      is available, else blockwise; on GPU cuDNN for bfloat16 compute and head dims cuDNN takes,
      else XLA; on TPU splash), 'xla', 'blockwise', 'fused' (dagmoe_jax.kernels; CPU, float32,
      single device), 'cudnn', 'triton' (JAX's Pallas Triton flash attention: GPUs sm80+,
      single device, no cuDNN needed) or 'splash' (Pallas TPU kernel); 'triton' and 'splash'
      run XLA's attention for sequences that are not a multiple of 128.
    grouped_matmul: how 'dropless' dispatch runs its experts: 'auto' (default: 'gmm' on TPU
      when d_model and the expert hidden size are multiples of 128; on GPU 'mgpu' on Hopper
      (sm90) and 'triton' on Ampere and newer (sm80+) where the dtype and dims allow, else
      'ragged_dot'; on CPU off-mesh 'cpu_gmm' when a C++ compiler is available; else
      'ragged_dot'), 'ragged_dot' (jax.lax.ragged_dot; XLA:GPU rewrites it into a dense dot
      over zero-padded groups), 'gmm' (megablox, Pallas TPU), 'mgpu' (JAX's Mosaic GPU
      kernels, Hopper, 16-bit, dims multiples of 64), 'triton' (this library's Pallas Triton
      kernel, sm80+, dims multiples of 16), 'cpu_gmm' (dagmoe_jax.kernels C++ kernel; CPU,
      single device; XLA:CPU's ragged_dot is 40-100x slower) or 'einsum' (every expert on
      every token, then the selected ones: N times the work, the tests' oracle; one device's
      view).
    expert_exchange: how expert-parallel 'dropless' dispatch moves tokens between the expert
      shards of a mesh: 'auto' (default: 'ragged_all_to_all' on GPU / TPU, 'all_gather' on
      CPU, whose XLA does not implement the ragged collective), 'ragged_all_to_all' (each
      assignment sent to its expert's device only) or 'all_gather' (every token to every
      expert shard, outputs reduce-scattered back).
    fuse_projections: one matmul against [W_gate | W_up] in SwiGLU and against [W_q | W_k | W_v]
      in attention (CPU steps 3% and 8% faster); None (default) settles to True on one device
      and False under a mesh, where the concatenation would move tensor-sharded weights.
      Dropless dispatch's grouped matmuls run gate and up apart either way.
    dag_module: how the DAG module (DAG-MoE eq. 7's LayerNorm, eq. 9-10's pairwise messages
      summed over the senders, the projections of eq. 8, 9 and 11) runs: 'auto' (default,
      each choice on a measurement or, between XLA's own programs, the roofline's ranking,
      printed with the run's settings: 'fused' on CPU for float32 on one device when a C++
      compiler is available and d_model and d_g are multiples of 16, else 'xla' there;
      'bottleneck' on a GPU, where 'triton' ran 3.3x slower than XLA's iteration on an H200;
      'xla_rank3' on TPU, where 'pallas' is estimated only), 'bottleneck' (eq. 6-12 by XLA in
      d_g, dagmoe_jax.families.moe.dag.bottleneck: the experts' outputs projected once, no d-wide
      node built; any backend and mesh), 'xla' (the K x K pair
      tensor built by XLA, the projections on [T*K, .] rows: free reshapes on CPU and GPU),
      'xla_rank3' (the same with the projections on the [T, K, .] node arrays as they are:
      on TPU the reshape to rows is a copy between tiled layouts) or 'fused'
      (dagmoe_jax.kernels C++ kernels, which never build the pair tensor and run the
      projections' weight gradients; CPU, float32, single device) or 'triton'
      (dagmoe_jax.kernels.triton_dag_module: each iteration one Pallas Triton kernel forward
      and one backward; NVIDIA sm80+, single device, d_g and top_k powers of two, d_model a
      multiple of 16) or 'pallas' (dagmoe_jax.kernels.pallas_dag_module: the same as Pallas
      Mosaic kernels on the [K, T, d] nodes; TPU, any mesh, d_model and d_g multiples of
      128).
    attention_block: query/key block size of the blockwise causal attention (64 measured
      fastest for the s model on the 2-core CPU: 32 and 128 were 5-10% slower).
    loss_chunk: tokens per device in a chunk of the vocabulary-tiled loss; 0 (default) means
      auto: 512 on CPU, 4096 on GPU / TPU, where smaller chunks re-read the LM head and its
      float32 gradient until the head is bound by HBM (model/settle.py).
    """

    remat: str = "auto"
    scan_unroll: int = 0
    attention: str = "auto"
    grouped_matmul: str = "auto"
    expert_exchange: str = "auto"
    fuse_projections: Optional[bool] = None
    dag_module: str = "auto"
    attention_block: int = 64
    loss_chunk: int = 0

    def __post_init__(self):
        c = "ExecutionConfig"
        _choice(c, "remat", self.remat, REMAT_POLICIES)
        _nonnegative_int(c, "scan_unroll", self.scan_unroll)
        _choice(c, "attention", self.attention, ATTENTION_IMPLS)
        _choice(c, "grouped_matmul", self.grouped_matmul, GROUPED_MATMULS)
        _choice(c, "expert_exchange", self.expert_exchange, EXPERT_EXCHANGES)
        _choice(c, "dag_module", self.dag_module, DAG_MODULES)
        _check(self.fuse_projections in (None, True, False), c, "fuse_projections",
               self.fuse_projections, "True, False or None (auto)")
        _positive(c, "attention_block", self.attention_block)
        _nonnegative_int(c, "loss_chunk", self.loss_chunk)

    @property
    def unsettled(self) -> tuple:
        """The fields still 'auto' (settled by :func:`dagmoe_jax.model.settle.settle`): every
        field but ``attention_block`` (a size, not a choice) defaults to its 'auto'."""
        return tuple(f.name for f in dataclasses.fields(self)
                     if f.name != "attention_block" and getattr(self, f.name) == f.default)
