"""The block families' registry: each family registers its config class here, and every layer
finds the rest of the family through it (docs/design.md section 11).

A family is one package, ``dagmoe_jax.families.<kind>``, whose modules sit in the layers their
names say (``tests/test_imports.py``):

* ``config``: the family's config, a frozen dataclass registered with :func:`register`, with a
  ``kind`` field (``init=False``, its name), a ``label`` property (its name in progress lines),
  ``describe()`` (its shape in a few words), ``from_legacy(blob)`` (its fields in a model
  config saved while they sat at the top level) and the class attribute ``hf_family`` (the
  Hugging Face family it maps to, or None); what else of the family gin binds is registered
  with it (``configurables``: the MoE family's ``AggregationConfig`` and
  ``matched_shared_hidden``);
* ``block``: the block a ``Transformer`` layer holds, as ``BLOCK`` (the block protocol:
  :mod:`dagmoe_jax.model.block`);
* ``accounting``: ``layer_counts(cfg)`` (one layer's parameters and FLOPs), optionally
  ``model_counts(cfg)`` (what it holds outside the layers), and ``grouped_matmul_width(cfg)``;
* optional: ``extension`` (its hooks into the run, as ``EXTENSION``) in the run layer;
  ``analysis`` (its ``analyze``) and ``command`` among the tools.

A layer asks for a family with :func:`family_of` (by a block config or its kind) and for a
part with :meth:`Family.part`, and never names a family's module: the families stand above
the core and reach it, never the other way (``farm-studio look``: no arrow back up). Adding a
family is a package and its name in :data:`KINDS`.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Dict, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Family:
    """A block family: its ``kind`` (``ModelConfig.block``'s name for it), its config class,
    the package that holds the rest of it, and what else of it gin binds (``configurables``:
    config classes and functions, :func:`register`)."""

    kind: str
    config: type
    package: str
    configurables: Tuple = ()

    def part(self, name: str) -> Optional[ModuleType]:
        """The family's module ``name`` ('block', 'accounting', 'extension', 'analysis'),
        imported on first use; None when the family has no such module."""
        module = f"{self.package}.{name}"
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name == module:
                return None
            raise


# The block families (``ModelConfig.block``'s choices, in this order): each the package
# ``dagmoe_jax.families.<kind>``, whose ``config`` module registers the family when imported.
KINDS = ("dense", "moe", "coe", "doe")

# Every registered family by kind, in the order their configs were imported.
FAMILIES: Dict[str, Family] = {}


def register(package: str, configurables: Tuple = ()):
    """Class decorator of a family's config (a frozen dataclass whose ``kind`` field is its
    name): registers it with ``package``, the family's package (its ``__package__``), and
    ``configurables``, what else of the family gin binds (its nested config classes beyond
    the core's router and experts, functions a gin file calls with ``@name()``)."""

    def add(cls: type) -> type:
        kind = cls.kind
        if kind in FAMILIES and FAMILIES[kind].config is not cls:
            raise ValueError(f"two block families are named {kind!r}: "
                             f"{FAMILIES[kind].config.__name__} and {cls.__name__}")
        FAMILIES[kind] = Family(kind, cls, package, tuple(configurables))
        return cls

    return add


def family_of(block) -> Family:
    """The family of a block config, or of a family's name (one of :data:`KINDS`): its config
    module imported on first use."""
    kind = block if isinstance(block, str) else block.kind
    if kind not in FAMILIES and kind in KINDS:
        importlib.import_module(f"dagmoe_jax.families.{kind}.config")
    return FAMILIES[kind]


def all_families() -> Dict[str, Family]:
    """Every family of :data:`KINDS` by kind, in that order (their configs imported)."""
    return {kind: family_of(kind) for kind in KINDS}
