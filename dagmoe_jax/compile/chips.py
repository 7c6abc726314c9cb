"""TPU chips by their datasheets, and the devices of a topology compiled for from this host.

``topology_devices('v5p:2x2x1')`` returns the compile-only devices of that slice
(``jax.experimental.topologies.get_topology_desc``; the TPU compiler comes from the ``libtpu``
wheel, ``pip install 'jax[tpu]==<jax>'``, and needs no TPU on the machine). :data:`CHIPS`
holds the datasheet figures the step-time estimate uses (:mod:`dagmoe_jax.compile.roofline`).

The figures are Google Cloud's published per-chip specifications ("TPU v5p", "TPU v5e",
"TPU v6e" pages of the Cloud TPU documentation): bf16 peak, HBM capacity and bandwidth, the
bidirectional inter-chip interconnect (ICI) bandwidth per chip and the number of ICI ports,
and the data-centre network (DCN) bandwidth per chip that multi-slice collectives cross.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, List, Tuple


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's datasheet figures (per chip; bytes and bytes/s, FLOP/s)."""

    name: str                # the topology prefix: 'v5p', 'v5e', 'v6e'
    peak_flops: float        # bf16 dense matmul peak
    hbm_bytes: float
    hbm_bandwidth: float
    ici_bandwidth: float     # bidirectional, all ports together
    ici_ports: int           # torus links per chip (3D torus: 6, 2D torus: 4)
    dcn_bandwidth: float     # per chip, between slices
    cores_per_chip: int      # TensorCores: the v5p-N accelerator type counts cores

    @property
    def ring_bandwidth(self) -> float:
        """Bytes/s one chip sends into a collective that runs as a bidirectional ring along
        one torus dimension: two of its links, each at ``ici_bandwidth / (2 ports)`` per
        direction, i.e. ``ici_bandwidth / ports``."""
        return self.ici_bandwidth / self.ici_ports


GB = 1e9
GIB = 2 ** 30

CHIPS: Dict[str, Chip] = {
    # 459 TFLOP/s bf16; 95 GiB HBM2e at 2,765 GB/s; ICI 1,200 GB/s bidirectional (4,800 Gbps),
    # 3D torus; DCN 50 Gbps per chip; 2 TensorCores
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765 * GB, 1200 * GB, 6, 50e9 / 8, 2),
    # 197 TFLOP/s bf16; 16 GB HBM2 at 819 GB/s; ICI 400 GB/s bidirectional, 2D torus; 2 x 100
    # Gbps NICs per 8-chip host (25 Gbps per chip); 1 TensorCore
    "v5e": Chip("v5e", 197e12, 16 * GB, 819 * GB, 400 * GB, 4, 25e9 / 8, 1),
    # 918 TFLOP/s bf16; 32 GB HBM at 1,638 GB/s; ICI 800 GB/s bidirectional, 2D torus; DCN
    # taken as v5e's per chip (the page gives none); 1 TensorCore
    "v6e": Chip("v6e", 918e12, 32 * GB, 1638 * GB, 800 * GB, 4, 25e9 / 8, 1),
}

_TOPOLOGY = re.compile(r"^(v5p|v5e|v6e):(\d+(?:x\d+){1,2})$")


def parse_topology(name: str) -> Tuple[Chip, Tuple[int, ...]]:
    """(chip, chip grid) of a topology name such as 'v5p:2x2x1' or 'v6e:8x8'; a one-line
    ``ValueError`` for anything else."""
    match = _TOPOLOGY.match(name.strip())
    if not match:
        raise ValueError(f"--topology={name!r} is not a TPU topology this command knows: "
                         f"expected {'|'.join(CHIPS)}:AxB[xC], e.g. v5p:2x2x1, v5p:4x4x4, "
                         f"v5e:4x4, v6e:8x8")
    chip = CHIPS[match.group(1)]
    grid = tuple(int(x) for x in match.group(2).split("x"))
    if chip.ici_ports == 6 and len(grid) != 3 or chip.ici_ports == 4 and len(grid) != 2:
        raise ValueError(f"--topology={name!r}: a {chip.name} slice is a "
                         f"{'3D (AxBxC)' if chip.ici_ports == 6 else '2D (AxB)'} grid of chips")
    return chip, grid


def accelerator_type(chip: Chip, chips: int) -> str:
    """Cloud TPU's accelerator type of ``chips`` chips ('v5p-8' is 4 chips of 2 cores)."""
    prefix = {"v5e": "v5litepod", "v6e": "v6e"}.get(chip.name, chip.name)
    return f"{prefix}-{chips * chip.cores_per_chip}"


def quiet_libtpu(chip: Chip, chips: int) -> None:
    """Environment for ``libtpu`` on a host that owns no TPU, set before it loads: without a
    worker hostname and an accelerator type it looks them up in the cloud metadata server, fails
    and prints a multi-line error to stderr (the compiled programs do not change). Values
    already set are kept; a real TPU VM sets its own."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # a lockfile otherwise: one process
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type(chip, chips))


def tpu_compiler_missing() -> str | None:
    """Why the TPU compiler cannot run here (None when ``libtpu`` is installed)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        import jax
        return (f"the TPU compiler is not installed: pip install 'jax[tpu]=={jax.__version__}' "
                f"(it brings the libtpu wheel, about 700 MB)")
    return None


def topology_devices(name: str, num_slices: int = 1) -> Tuple[Chip, List]:
    """(chip, compile-only devices) of ``num_slices`` slices of topology ``name``; one-line
    ``ValueError`` when the name is unknown or the TPU compiler is missing."""
    chip, grid = parse_topology(name)
    if num_slices < 1:
        raise ValueError(f"--num_slices={num_slices} is invalid: expected an integer >= 1")
    missing = tpu_compiler_missing()
    if missing:
        raise ValueError(missing)
    chips = 1
    for g in grid:
        chips *= g
    quiet_libtpu(chip, chips)
    from jax.experimental import topologies
    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs)
    except Exception as err:   # libtpu's own message, e.g. a grid it has no host layout for
        raise ValueError(f"libtpu cannot describe topology {name!r} x {num_slices} slices: "
                         f"{str(err).splitlines()[0]}") from None
    return chip, list(topology.devices)
