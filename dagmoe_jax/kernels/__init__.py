"""Hand-written XLA:CPU kernels (C++ XLA FFI), compiled on first use and cached on disk.

The only one so far is a fused causal grouped-query attention (:mod:`.attention`), which
``ExecutionConfig.attention='auto'`` picks on CPU for float32 when a C++ compiler is available.
"""

from dagmoe_jax.kernels.attention import (SUPPORTED_HEAD_DIMS, fused_attention_unavailable,
                                          fused_causal_attention)

__all__ = ["SUPPORTED_HEAD_DIMS", "fused_attention_unavailable", "fused_causal_attention"]
