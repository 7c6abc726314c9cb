"""The device mesh ``data, fsdp, expert, tensor`` (docs/design.md section 8) and activating it.

``make_mesh(MeshConfig(expert=4))`` lays the devices out on the four named axes (the remaining
devices go to ``data``); ``activate(mesh)`` sets that mesh (``jax.set_mesh``) and the logical axis
rules (:data:`DEFAULT_RULES`), which turns on every :func:`constrain` in the model and the
expert-parallel dispatch. Outside ``activate`` the model runs exactly as on one device.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import jax
from flax.core import spmd
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from dagmoe_jax.parallel.config import MeshConfig
from dagmoe_jax.parallel.axes import DEFAULT_RULES, MESH_AXES


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Optional[Sequence] = None,
              num_slices: int = 1) -> Mesh:
    """A ``jax.sharding.Mesh`` over ``devices`` (default: all, every process) with axes
    ``data, fsdp, expert, tensor``, all of type ``Auto`` (sharding by constraints, GSPMD).

    On a TPU torus an axis whose size is no product of whole physical axes (32 chips of a
    4x4x4 slice) splits a physical axis, as ``mesh_utils`` allows when asked. Over
    ``num_slices`` slices (multi-slice, the devices of every slice) the ``data`` axis spans
    them: each slice holds ``data / num_slices`` of it and every other axis whole, so only
    data parallelism crosses the slower data-centre network."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.resolve(len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if num_slices > 1:
        if sizes[0] % num_slices:
            raise ValueError(f"MeshConfig.data={sizes[0]} must be a multiple of --num_slices="
                             f"{num_slices}: data parallelism is what spans the slices")
        ici = (sizes[0] // num_slices,) + tuple(sizes[1:])
        dcn = (num_slices,) + (1,) * (len(sizes) - 1)
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
    try:
        return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
        grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)


@contextlib.contextmanager
def activate(mesh: Mesh, rules=DEFAULT_RULES) -> Iterator[Mesh]:
    """Set ``mesh`` (``jax.set_mesh``) and the logical axis ``rules`` for the ``with`` body.

    Trace (first call of a jitted function) and run model code inside it: :func:`constrain`
    then shards activations, and MoE blocks dispatch tokens across devices when the mesh has
    more than one device.
    """
    with jax.set_mesh(mesh), spmd.logical_axis_rules(tuple(rules)):
        yield mesh


def parallel_active() -> bool:
    """True inside :func:`activate` with a mesh of more than one device (while tracing too)."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(spmd.get_logical_axis_rules()) and mesh is not None and not mesh.empty \
        and mesh.size > 1
