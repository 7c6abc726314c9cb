"""The device mesh ``data, fsdp, expert, tensor`` (docs/design.md section 8) and activating it.

``make_mesh(MeshConfig(expert=4))`` lays the devices out on the four named axes (the remaining
devices go to ``data``); ``activate(mesh)`` sets that mesh (``jax.set_mesh``) and the logical axis
rules (:data:`DEFAULT_RULES`), which turns on every :func:`constrain` in the model and the
expert-parallel dispatch. Outside ``activate`` the model runs exactly as on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator, Optional, Sequence, Tuple

import jax
from flax.core import spmd
from jax.sharding import AxisType, Mesh

from dagmoe_jax.validate import check as _check
from dagmoe_jax.parallel.axes import DEFAULT_RULES, MESH_AXES


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; their product must be the number of devices.

    data: data parallelism (batch rows; parameters replicated). -1 (default) takes the devices
        the other axes leave.
    fsdp: fully sharded data parallelism: batch rows, and parameters' ``embed`` axis sharded.
    expert: expert parallelism: routed experts sharded; tokens reach them by all-to-all. Outside
        the MoE blocks this axis is extra data parallelism.
    tensor: tensor parallelism of attention heads, FFN / expert hidden units and the vocabulary.

    At most one size may be -1 (filled in from the device count by :meth:`resolve`).
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            value = getattr(self, name)
            is_int = isinstance(value, int) and not isinstance(value, bool)
            _check(is_int and (value >= 1 or value == -1), "MeshConfig", name, value,
                   "an integer >= 1, or -1 to fill the devices left")
        filled = [name for name in MESH_AXES if getattr(self, name) == -1]
        _check(len(filled) <= 1, "MeshConfig", filled[-1] if filled else "data", -1,
               f"at most one size of -1, but {', '.join(filled)} are all -1")

    def sizes(self) -> Tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_AXES)

    def resolve(self, num_devices: int) -> Tuple[int, int, int, int]:
        """Axis sizes (data, fsdp, expert, tensor) for ``num_devices`` devices, -1 filled in;
        a one-line ``ValueError`` if they cannot multiply to ``num_devices``."""
        sizes = self.sizes()
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes and num_devices % known == 0:
            sizes = tuple(num_devices // known if s == -1 else s for s in sizes)
        if math.prod(sizes) != num_devices:
            given = ", ".join(f"{n}={s}" for n, s in zip(MESH_AXES, self.sizes()))
            raise ValueError(f"MeshConfig({given}) does not fit {num_devices} devices: expected "
                             f"sizes whose product is {num_devices} (one may be -1 to fill)")
        return sizes


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Optional[Sequence] = None) -> Mesh:
    """A ``jax.sharding.Mesh`` over ``devices`` (default: all, every process) with axes
    ``data, fsdp, expert, tensor``, all of type ``Auto`` (sharding by constraints, GSPMD)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.resolve(len(devices))
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


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
