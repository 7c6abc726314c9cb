"""TPU chips and NVIDIA GPUs by their datasheets, and the devices of a topology compiled for
from this host.

``topology_devices('v5p:2x2x1')`` returns the compile-only devices of that TPU slice
(``jax.experimental.topologies.get_topology_desc``; the TPU compiler comes from the ``libtpu``
wheel, ``pip install 'jax[tpu]==<jax>'``, and needs no TPU on the machine);
``topology_devices('h100')`` (or 'h100:8', one 8-GPU node; 'h200', 'a100') those of NVIDIA
GPUs, compiled by XLA:GPU from the CUDA plugin (``jax-cuda13-plugin`` and ``jax-cuda13-pjrt``
of the pinned jax, installed without their nvidia-* wheels) and CUDA's ``ptxas``, for the
target described by a ``GpuTargetConfigProto`` shipped in ``gpu_targets/`` (SM count, shared
memory, compute capability: what the compiler and the kernels tile for). :data:`CHIPS` holds
the datasheet figures the step-time estimate uses (:mod:`dagmoe_jax.compile.roofline`).

The TPU figures are Google Cloud's published per-chip specifications ("TPU v5p", "TPU v5e",
"TPU v6e" pages of the Cloud TPU documentation): bf16 peak, HBM capacity and bandwidth, the
bidirectional inter-chip interconnect (ICI) bandwidth per chip and the number of ICI ports,
and the data-centre network (DCN) bandwidth per chip that multi-slice collectives cross. The
GPU figures are NVIDIA's datasheets for the SXM parts (dense bf16 Tensor Core peak, HBM, NVLink
bandwidth per GPU in both directions, which collectives within a node cross; the InfiniBand
NIC per GPU of a DGX / HGX node between nodes); the HBM is the device memory the target
reports.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dagmoe_jax.compile import ptxas


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's datasheet figures (per chip; bytes and bytes/s, FLOP/s)."""

    name: str                # the topology prefix: 'v5p', 'v5e', 'v6e'
    peak_flops: float        # bf16 dense matmul peak
    hbm_bytes: float
    hbm_bandwidth: float
    ici_bandwidth: float     # bidirectional, all ports together
    ici_ports: int           # torus links per chip (3D torus: 6, 2D torus: 4)
    dcn_bandwidth: float     # per chip, between slices (GPUs: between nodes)
    cores_per_chip: int      # TensorCores: the v5p-N accelerator type counts cores
    platform: str = "tpu"    # 'tpu' or 'gpu'
    sm_count: int = 0        # GPUs: streaming multiprocessors
    host_bandwidth: float = 32e9   # the host link, one direction (PCIe Gen4 x16 unless named)
    card: str = ""           # the part the figures are for, as reports name it

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
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765 * GB, 1200 * GB, 6, 50e9 / 8, 2,
                card="TPU v5p"),
    # 197 TFLOP/s bf16; 16 GB HBM2 at 819 GB/s; ICI 400 GB/s bidirectional, 2D torus; 2 x 100
    # Gbps NICs per 8-chip host (25 Gbps per chip); 1 TensorCore
    "v5e": Chip("v5e", 197e12, 16 * GB, 819 * GB, 400 * GB, 4, 25e9 / 8, 1, card="TPU v5e"),
    # 918 TFLOP/s bf16; 32 GB HBM at 1,638 GB/s; ICI 800 GB/s bidirectional, 2D torus; DCN
    # taken as v5e's per chip (the page gives none); 1 TensorCore; the host over PCIe Gen5
    # (x16: 64 GB/s a direction)
    "v6e": Chip("v6e", 918e12, 32 * GB, 1638 * GB, 800 * GB, 4, 25e9 / 8, 1,
                host_bandwidth=64e9, card="TPU v6e (Trillium)"),
    # NVIDIA H100 SXM5: 989 TFLOP/s dense bf16; 80 GB HBM3 at 3.35 TB/s; NVLink 4 at 900 GB/s
    # per GPU (both directions, 18 links to the NVSwitches: a ring gets half each way);
    # 400 Gb/s InfiniBand per GPU; 132 SMs, sm_90; PCIe Gen5 x16 to the host
    "h100": Chip("h100", 989e12, 84942979072, 3350 * GB, 900 * GB, 2, 400e9 / 8, 1, "gpu",
                 132, 64e9, "NVIDIA H100 SXM5 80 GB"),
    # NVIDIA H200 SXM: the H100's compute with 141 GB HBM3e at 4.8 TB/s
    "h200": Chip("h200", 989e12, 150754820096, 4800 * GB, 900 * GB, 2, 400e9 / 8, 1, "gpu",
                 132, 64e9, "NVIDIA H200 SXM 141 GB"),
    # NVIDIA A100 SXM4 80GB: 312 TFLOP/s dense bf16; HBM2e at 2,039 GB/s; NVLink 3 at 600 GB/s
    # per GPU; 200 Gb/s InfiniBand per GPU; 108 SMs, sm_80 (not the 40 GB card, nor PCIe's:
    # their HBM and bandwidth differ)
    "a100": Chip("a100", 312e12, 85198045184, 2039 * GB, 600 * GB, 2, 200e9 / 8, 1, "gpu",
                 108, 32e9, "NVIDIA A100 SXM4 80 GB"),
}

GPUS_PER_NODE = 8
"""The most GPUs one topology name describes ('h100:8': one HGX node, NVLink between all)."""

_TOPOLOGY = re.compile(r"^(v5p|v5e|v6e):(\d+(?:x\d+){1,2})$")
_ACCELERATOR_TYPE = re.compile(r"^(v5p|v5e|v5litepod|v6e)-(\d+)$")
STANDARD_GRIDS = {   # chips: the slice Cloud TPU gives an accelerator type of that many
    "3d": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
           256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"},
    "2d": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
           256: "16x16"},
}
"""Cloud TPU's default slice shapes by chip count (the v5p, v5e and v6e pages' tables), so
the accelerator type a user reserves ('v5p-8': 4 chips of 2 cores) names a grid."""


def grid_of_accelerator_type(name: str) -> Optional[str]:
    """'v5p:2x2x1' for 'v5p-8', 'v6e:16x16' for 'v6e-256' (a v5p's number counts cores, a
    v5e's and v6e's chips); None when ``name`` is not an accelerator type; a one-line
    ``ValueError`` for a count with no standard slice."""
    match = _ACCELERATOR_TYPE.match(name.strip())
    if not match:
        return None
    chip = CHIPS["v5e" if match.group(1) == "v5litepod" else match.group(1)]
    chips = int(match.group(2)) // chip.cores_per_chip
    grids = STANDARD_GRIDS["3d" if chip.ici_ports == 6 else "2d"]
    if int(match.group(2)) % chip.cores_per_chip or chips not in grids:
        raise ValueError(f"--topology={name!r}: {chip.name} has no standard slice of that size "
                         f"(accelerator types: " + ", ".join(
                             accelerator_type(chip, n) for n in grids) + "); or name the grid, "
                         f"e.g. {chip.name}:{grids[max(grids)]}")
    return f"{chip.name}:{grids[chips]}"
_GPU_TOPOLOGY = re.compile(r"^(h100|h200|a100)(?::(\d+))?$")


def parse_topology(name: str) -> Tuple[Chip, Tuple[int, ...]]:
    """(chip, chip grid) of a topology name such as 'v5p:2x2x1', 'v6e:8x8', an accelerator
    type ('v5p-8', 'v6e-256': :func:`grid_of_accelerator_type`), 'h100' or 'h100:8' (a GPU's
    grid is its GPU count); a one-line ``ValueError`` for anything else."""
    name = grid_of_accelerator_type(name) or name
    gpu = _GPU_TOPOLOGY.match(name.strip())
    if gpu:
        count = int(gpu.group(2) or 1)
        if not 1 <= count <= GPUS_PER_NODE:
            raise ValueError(f"--topology={name!r}: one node holds 1 to {GPUS_PER_NODE} GPUs")
        return CHIPS[gpu.group(1)], (count,)
    match = _TOPOLOGY.match(name.strip())
    if not match:
        tpus = "|".join(c for c, chip in CHIPS.items() if chip.platform == "tpu")
        gpus = "|".join(c for c, chip in CHIPS.items() if chip.platform == "gpu")
        raise ValueError(f"--topology={name!r} is not a topology this command knows: "
                         f"expected {tpus}:AxB[xC] (e.g. v5p:2x2x1, v5p:4x4x4, v5e:4x4, "
                         f"v6e:8x8), an accelerator type (v5p-8, v6e-256) or "
                         f"{gpus}[:GPUS] (e.g. h100, h100:8, a100)")
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


def gpu_target_config(chip: Chip) -> str:
    """The ``GpuTargetConfigProto`` (text form) of a GPU chip, shipped in ``gpu_targets/``."""
    return (Path(__file__).with_name("gpu_targets") / f"{chip.name}.txtpb").read_text()


def ptxas_path() -> Optional[str]:
    """CUDA's ``ptxas`` (on PATH, under ``CUDA_HOME`` / /usr/local/cuda, or in the
    ``nvidia-cuda-nvcc`` wheel), which XLA:GPU runs on every kernel it compiles; None when
    there is none."""
    found = shutil.which("ptxas")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    try:
        import nvidia.cuda_nvcc as nvcc   # the nvidia-cuda-nvcc wheel
        homes += list(getattr(nvcc, "__path__", []))
    except ImportError:
        pass
    for home in filter(None, homes):
        candidate = Path(home) / "bin" / "ptxas"
        if candidate.is_file():
            return str(candidate)
    return None


def gpu_compiler_missing() -> Optional[str]:
    """Why XLA:GPU cannot compile here (None when the CUDA plugin and ``ptxas`` are there)."""
    import jax
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        return (f"the GPU compiler is not installed: pip install --no-deps "
                f"jax-cuda13-plugin=={jax.__version__} jax-cuda13-pjrt=={jax.__version__} "
                f"(requirements-gpu-compile.txt; no GPU or nvidia-* wheels needed)")
    if ptxas_path() is None:
        return ("CUDA's ptxas is not found (XLA:GPU assembles every kernel with it): install "
                "the CUDA toolkit, put its bin/ on PATH or set CUDA_HOME, or pip install "
                "nvidia-cuda-nvcc")
    return None


def gpu_devices(chip: Chip, count: int) -> List:
    """Compile-only devices of ``count`` GPUs of ``chip`` in one node (the process's own
    backend stays the CPU: JAX_PLATFORMS=cpu keeps the plugin from looking for a GPU)."""
    missing = gpu_compiler_missing()
    if missing:
        raise ValueError(missing)
    # XLA runs the ptxas on PATH: ours, which also records what it assembles (compile/ptxas.py)
    ptxas.install(ptxas_path())
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(platform="cuda",
                                                target_config=gpu_target_config(chip),
                                                topology=f"1x1x{count}")
    except Exception as err:
        raise ValueError(f"the CUDA plugin cannot describe {count} x {chip.name}: "
                         f"{str(err).splitlines()[0]}") from None
    return list(topology.devices)


def topology_devices(name: str, num_slices: int = 1) -> Tuple[Chip, List]:
    """(chip, compile-only devices) of ``num_slices`` slices of topology ``name`` (GPUs: one
    node); one-line ``ValueError`` when the name is unknown or its compiler is missing."""
    name = grid_of_accelerator_type(name) or name
    chip, grid = parse_topology(name)
    if num_slices < 1:
        raise ValueError(f"--num_slices={num_slices} is invalid: expected an integer >= 1")
    if chip.platform == "gpu":
        if num_slices > 1:
            raise ValueError(f"--num_slices={num_slices}: a GPU topology is one node "
                             f"(--topology={chip.name}:{GPUS_PER_NODE})")
        return chip, gpu_devices(chip, grid[0])
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


def mesh_label(sizes) -> str:
    """'data 2 x expert 2' for a mesh's axis sizes (axes of size 1 left out)."""
    return " x ".join(f"{a} {n}" for a, n in dict(sizes).items() if n > 1) or "1 chip"
