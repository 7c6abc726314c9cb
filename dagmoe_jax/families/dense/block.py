"""The dense block: one SwiGLU, the Llama FFN, under the block protocol
(:mod:`dagmoe_jax.model.block`)."""

from __future__ import annotations

from typing import Optional

from flax import nnx

from dagmoe_jax.config import ExecutionConfig, ModelConfig
from dagmoe_jax.model.block import BlockInputs, empty_stats
from dagmoe_jax.model.layers import SwiGLU, dtype_of
from dagmoe_jax.parallel.axes import MeshLayout


class DenseBlock(SwiGLU):
    """The dense block: one SwiGLU of ``ModelConfig.resolved_ffn_hidden`` (its parameters are
    the SwiGLU's own, so a dense layer's state paths are ``block/w_gate`` ...)."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig,
                 layout: Optional[MeshLayout] = None, *, rngs: nnx.Rngs):
        del layout                           # nothing to dispatch
        super().__init__(cfg.d_model, cfg.resolved_ffn_hidden, cfg.init_std,
                         dtype_of(cfg.compute_dtype),
                         fuse_projections=execution.fuse_projections,
                         param_dtype=dtype_of(cfg.param_dtype), rngs=rngs)

    def __call__(self, inputs: BlockInputs):
        return super().__call__(inputs.x), empty_stats()


# The family's block (dagmoe_jax.config.families).
BLOCK = DenseBlock
