"""Each block family's hooks into the run around the model
(:class:`~dagmoe_jax.data.extension.Extension`), in one table: the run is built with them, the
model never names them."""

from __future__ import annotations

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.data.extension import Extension
from dagmoe_jax.data.topics.extension import DoEExtension

# The families whose run needs more than the token stream; every other block gets the no-op.
EXTENSIONS = {"doe": DoEExtension}


def extension_for(cfg: ModelConfig) -> Extension:
    """The hooks of ``cfg``'s block family (the no-op :class:`Extension` for a block without
    any)."""
    return EXTENSIONS.get(cfg.block.kind, Extension)(cfg)
