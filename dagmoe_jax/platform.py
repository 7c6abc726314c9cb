"""JAX on the CPU alone where the host has no accelerator: the one thing ``import dagmoe_jax``
does to JAX (standard library only, before JAX loads).

The environments README and docs have a user build install JAX's plugins beside it: the CUDA
compiler plugin (``requirements-gpu-compile.txt``, for deviceless GPU compiles) and libtpu
(``requirements-tpu.txt``). On a host without their hardware JAX still starts each of them at
the first computation: the CUDA plugin printed an "Unable to load cuDNN" traceback, libtpu its
worker-hostname warnings, and with torch's nvidia-* runtime libraries beside them the CUDA
plugin's version check crashed the process (exit 139) in a notebook's first ``jnp`` call. So,
where nothing says otherwise and no accelerator is visible, JAX is told to use the CPU, which
is what it falls back to there anyway. ``JAX_PLATFORMS`` set by the user, JAX's own
``jax_platforms``, or backends already started are left alone; so is any host with a device
file of an NVIDIA or AMD GPU (or WSL's) or a Google TPU on its PCI bus (JAX's own probes,
read without JAX). Deviceless compiles (``dagmoe-compile``) do not need the plugin's backend.
"""

from __future__ import annotations

import glob
import os
import sys

GOOGLE_PCI_VENDOR = "0x1ae0"     # the vendor of TPU chips on the PCI bus (JAX's probe)


def accelerator_visible() -> bool:
    """Whether this host shows a GPU or TPU device: NVIDIA's device files or driver entry,
    AMD's ``/dev/kfd``, WSL's ``/dev/dxg``, a Google device on the PCI bus or ``/dev/accel*``."""
    if glob.glob("/dev/nvidia[0-9]*") or os.path.isdir("/proc/driver/nvidia/gpus"):
        return True
    if os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg") or glob.glob("/dev/accel*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor, encoding="ascii") as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def cpu_where_no_accelerator() -> bool:
    """Tell JAX to use the CPU (module docstring) where nothing says otherwise and no
    accelerator is visible; returns whether it did."""
    if os.environ.get("JAX_PLATFORMS") or accelerator_visible():
        return False
    jax = sys.modules.get("jax")
    if jax is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
        return True
    try:
        from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
        if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
            return False
        jax.config.update("jax_platforms", "cpu")
    except (ImportError, AttributeError):
        return False
    return True
