"""Validated configuration of the device mesh: ``MeshConfig`` (exposed to gin; every config
dataclass lives in a module named ``config.py`` beside the code it configures)."""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

from dagmoe_jax.parallel.axes import MESH_AXES
from dagmoe_jax.validate import check as _check

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
