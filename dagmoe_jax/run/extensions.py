"""Each block family's hooks into the run around the model
(:class:`~dagmoe_jax.data.extension.Extension`): the run is built with them, the model never
names them. A family that needs more than the token stream has an ``extension`` module whose
``EXTENSION`` is its class (:mod:`dagmoe_jax.config.families`)."""

from __future__ import annotations

from dagmoe_jax.config import ModelConfig, family_of
from dagmoe_jax.data.extension import Extension


def extension_for(cfg: ModelConfig) -> Extension:
    """The hooks of ``cfg``'s block family (the no-op :class:`Extension` for a block without
    any)."""
    module = family_of(cfg.block).part("extension")
    return (Extension if module is None else module.EXTENSION)(cfg)
