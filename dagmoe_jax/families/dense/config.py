"""The dense family's config: one SwiGLU, Llama's FFN (docs/design.md section 1)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from dagmoe_jax.config.families import register
from dagmoe_jax.validate import positive as _positive


@register(__package__)
@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """The dense block: one SwiGLU (Llama's FFN; docs/design.md section 1).

    ffn_hidden: its hidden size; None means 8/3 d_model rounded up to 128
      (:func:`~dagmoe_jax.config.blocks.default_ffn_hidden`).
    """

    # The Hugging Face family a model of this block imports from and exports to (a class
    # attribute, not a field): Llama's MLP.
    hf_family = "llama"
    kind: str = dataclasses.field(default="dense", init=False)
    ffn_hidden: Optional[int] = None

    def __post_init__(self):
        if self.ffn_hidden is not None:
            _positive("DenseConfig", "ffn_hidden", self.ffn_hidden)

    @staticmethod
    def from_legacy(blob: dict) -> dict:
        """This block's fields in a model config saved while they sat at its top level
        (``ModelConfig.migrate``)."""
        return {"ffn_hidden": blob.get("ffn_hidden")}

    @property
    def label(self) -> str:
        """The family's name in progress lines."""
        return "dense"

    def describe(self) -> str:
        """The block in a few words."""
        return "dense"
