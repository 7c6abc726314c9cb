"""Logical axis names (docs/design.md section 8) and activation sharding constraints.

Every parameter carries a tuple of logical names in its ``out_sharding`` metadata and every major
activation passes through :func:`constrain`. Outside a mesh with axis rules (the default on one
device) ``constrain`` returns its input unchanged, so the model code is the same on a laptop and a
pod; the rules below decide where each name lands on the mesh ``data, fsdp, expert, tensor``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import jax
from flax.core import spmd
from jax.sharding import AbstractMesh, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical name -> mesh axis (or axes). Outside MoE blocks `expert` acts as data parallelism.
# The expert-parallel dispatch (model/routed/expert_parallel.py) needs the `expert` axes among the `batch`
# axes (each expert shard holds different tokens) and `expert_mlp` not among them.
DEFAULT_RULES: Tuple[Tuple[str, object], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("expert_slots", None),
    ("dag", None),
    ("nodes", None),
    ("layers", None),
    ("dag_iters", None),
    ("coe_iters", None),
)


def logical_to_spec(names: Sequence[Optional[str]], rules=None) -> PartitionSpec:
    """Map logical axis names to a ``PartitionSpec`` with ``rules`` (default: the active rules).

    A mesh axis is used at most once per spec: a later name that maps to an axis already taken
    stays replicated, as in ``flax.linen.logical_to_mesh_axes``.
    """
    rules = dict(rules if rules is not None else (spmd.get_logical_axis_rules() or DEFAULT_RULES))
    used, out = set(), []
    for name in names:
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def constrain(x: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
    """Constrain activation ``x`` to the sharding its logical ``names`` map to.

    A no-op unless logical axis rules are active (``flax.core.spmd.logical_axis_rules``) and a
    mesh is set (``jax.set_mesh``), so single-device code pays nothing.
    """
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} axis names {tuple(names)} for a rank-{x.ndim} array")
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh is None or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


def replicated(tree):
    """Every array of ``tree`` replicated on every device of an active mesh (a no-op without
    one), so that every process can read it on the host."""
    return jax.tree.map(lambda x: constrain(x, (None,) * x.ndim), tree)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A device mesh (abstract: axis names, sizes and device kind) with the logical-axis rules
    in force.

    What the model needs to place expert-parallel dispatch (``jax.shard_map``) without reading
    the active mesh while tracing: the run builds it once from its mesh (:meth:`of`) and hands it
    to the model. ``None`` stands for one device.
    """

    mesh: AbstractMesh
    rules: Tuple[Tuple[str, object], ...] = DEFAULT_RULES

    @classmethod
    def of(cls, mesh, rules=DEFAULT_RULES) -> Optional["MeshLayout"]:
        """The layout of ``mesh`` (a ``Mesh`` or ``AbstractMesh``), or None for a mesh of one
        device (or none), where nothing is sharded."""
        if mesh is None or mesh.empty or mesh.size == 1:
            return None
        abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
        return cls(abstract, tuple(rules))

    @property
    def axis_sizes(self) -> Tuple[Tuple[str, int], ...]:
        return tuple((name, int(self.mesh.shape[name])) for name in self.mesh.axis_names)

    def size(self, names: Sequence[str]) -> int:
        """The number of devices along the mesh axes ``names``."""
        out = 1
        for name in names:
            out *= int(self.mesh.shape[name])
        return out
