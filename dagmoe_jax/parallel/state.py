"""Sharded parameters, optimizer state and batches (Flax guide "Scale up on multiple devices").

* :func:`create_sharded` builds any NNX object (a model, or a model and its optimizer) inside
  ``nnx.jit`` and constrains every variable to the sharding its logical names map to, so the
  parameters are created directly in their shards, never whole on one device.
* :func:`create_train_state` is that for a model and its ``nnx.Optimizer``: the optimizer moments
  inherit each parameter's logical names (``nnx.Optimizer`` copies the metadata), so they are
  sharded like the parameters; the step count is replicated.
* :func:`place_on_mesh` moves an existing object's variables onto the mesh the same way.
* :func:`shard_batch` turns each process's rows of a batch into global arrays sharded over the
  batch axes (``data, fsdp, expert``), multi-host safe.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple, TypeVar

import jax
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dagmoe_jax.parallel.axes import DEFAULT_RULES, logical_to_spec
from dagmoe_jax.parallel.mesh import activate

T = TypeVar("T")


def variable_spec(var: nnx.Variable, rules=DEFAULT_RULES) -> PartitionSpec:
    """The ``PartitionSpec`` of a variable: its ``out_sharding`` logical names mapped by
    ``rules``; replicated when it has none (e.g. the optimizer's step count)."""
    names = var.get_metadata().get("out_sharding")
    if not names:
        return PartitionSpec()
    return logical_to_spec(names, rules)


def state_specs(tree, rules=DEFAULT_RULES):
    """``tree`` (an ``nnx.State`` or graph of variables) with every variable's value replaced by
    its :func:`variable_spec`: the argument ``with_sharding_constraint`` wants."""
    return jax.tree.map(lambda v: v.replace(variable_spec(v, rules)), tree,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(factory: Callable[[], T], mesh: Mesh, rules=DEFAULT_RULES) -> T:
    """``factory()`` (an NNX object, or a tuple of them) created inside ``nnx.jit`` under ``mesh``
    with each variable constrained to its logical sharding: the arrays come out sharded and are
    never materialised whole on one device. The values equal eager construction on one device
    up to float rounding (the random bits are the same: JAX's threefry is partitionable; the
    jitted normal transform may differ in the last bit)."""

    @nnx.jit
    def init():
        obj = factory()
        state = nnx.state(obj)
        nnx.update(obj, jax.lax.with_sharding_constraint(state, state_specs(state, rules)))
        return obj

    with activate(mesh, rules):
        return init()


def place_on_mesh(obj: T, mesh: Mesh, rules=DEFAULT_RULES) -> T:
    """Move an existing NNX object's variables (e.g. a model built on one device) onto ``mesh``
    in their logical shardings, in place; returns ``obj``. Unlike :func:`create_sharded` the
    arrays existed whole first, so this is for small models, tests and tools."""
    state = nnx.state(obj)
    shardings = jax.tree.map(lambda v: v.replace(NamedSharding(mesh, variable_spec(v, rules))),
                             state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.update(obj, jax.device_put(state, shardings))
    return obj


def create_abstract(factory: Callable[[], T], mesh: Mesh, rules=DEFAULT_RULES) -> T:
    """``factory()`` with no arrays made (``nnx.eval_shape`` under ``mesh``): every variable a
    ``ShapeDtypeStruct`` carrying the sharding its logical names map to, what
    :func:`create_sharded` would give. A program is lowered and compiled on these for a mesh
    this host does not have (a compile-only topology)."""
    with activate(mesh, rules):
        obj = nnx.eval_shape(factory)

    def shard(v):
        value = v.get_value()
        return v.replace(jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=NamedSharding(mesh, variable_spec(v, rules))))
    for part in (obj if isinstance(obj, tuple) else (obj,)):
        nnx.update(part, jax.tree.map(shard, nnx.state(part),
                                      is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return obj


def create_train_state(model_factory: Callable[[], nnx.Module], tx, mesh: Mesh,
                       rules=DEFAULT_RULES, wrt=nnx.Param, abstract: bool = False
                       ) -> Tuple[nnx.Module, nnx.Optimizer]:
    """(model, ``nnx.Optimizer(model, tx, wrt=wrt)``), both created sharded by one jitted init
    (``abstract``: shapes and shardings only, :func:`create_abstract`)."""

    def factory():
        model = model_factory()
        return model, nnx.Optimizer(model, tx, wrt=wrt)

    return (create_abstract if abstract else create_sharded)(factory, mesh, rules)


def batch_sharding(mesh: Mesh, ndim: int, rules=DEFAULT_RULES) -> NamedSharding:
    """Leading (batch) axis over the mesh axes the ``batch`` rule names, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def mesh_axes(name: str, rules=DEFAULT_RULES) -> Tuple[str, ...]:
    """The mesh axes the logical axis ``name`` maps to under ``rules`` (maybe none)."""
    spec = logical_to_spec((name,), rules)[0]
    return (spec,) if isinstance(spec, str) else tuple(spec or ())


def batch_axes(rules=DEFAULT_RULES) -> Tuple[str, ...]:
    """The mesh axes a batch's rows are sharded over (the ``batch`` rule)."""
    return mesh_axes("batch", rules)


def batch_shards(mesh, rules=DEFAULT_RULES) -> int:
    """How many row shards a batch has on ``mesh``: the product of the batch axes' sizes."""
    return int(np.prod([mesh.shape[a] for a in batch_axes(rules)]))


def active_batch_shards() -> int:
    """:func:`batch_shards` of the active mesh and rules (1 outside :func:`activate`): what a
    function that sees the global batch multiplies a per-device size by."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh is None or mesh.empty:
        return 1
    return batch_shards(mesh, rules)


def active_row_axes(rows: int, whole: Sequence[str] = ()) -> Optional[Tuple[str, ...]]:
    """The mesh axes (of size > 1) the active mesh's batch axes split ``rows`` over, for code
    that runs per device inside a ``shard_map``: None outside :func:`activate`, on one row
    shard, when the shards do not divide ``rows``, or when the rules shard one of the logical
    axes named in ``whole`` (which that code needs whole on every device)."""
    axes = active_mesh_axes("batch")
    shards = active_axes_size(axes)
    if shards == 1 or rows % shards or any(active_mesh_axes(name) for name in whole):
        return None
    return axes


def active_mesh_axes(name: str) -> Tuple[str, ...]:
    """The mesh axes (of size > 1) the active rules map the logical axis ``name`` to on the
    active mesh; () outside :func:`activate`."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh is None or mesh.empty:
        return ()
    return tuple(a for a in mesh_axes(name, rules) if mesh.shape[a] > 1)


def active_axes_size(axes: Sequence[str]) -> int:
    """How many shards the active mesh's ``axes`` make together (1 outside :func:`activate`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    return int(np.prod([mesh.shape[a] for a in axes]))


def shard_batch(batch: Dict[str, np.ndarray], mesh: Mesh, rules=DEFAULT_RULES,
                global_rows: Optional[int] = None) -> Dict[str, jax.Array]:
    """Global ``jax.Array`` s from this process's rows of every entry of ``batch``.

    Each process passes its own rows (``DataConfig.batch_size / process_count`` of them; with
    one process, the whole batch); the result has ``global_rows`` rows (default: local rows x
    process count) sharded over the batch axes. A row count the batch axes do not divide is a
    one-line ``ValueError``.
    """
    shards = batch_shards(mesh, rules)
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        rows = global_rows or value.shape[0] * jax.process_count()
        if rows % shards:
            raise ValueError(f"batch[{key!r}] has {rows} rows, which the {shards} devices of the "
                             f"batch mesh axes {batch_axes(rules)} do not divide: expected a "
                             f"multiple of {shards}")
        out[key] = jax.make_array_from_process_local_data(
            batch_sharding(mesh, value.ndim, rules), value, (rows,) + value.shape[1:])
    return out
