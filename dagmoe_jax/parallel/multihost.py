"""Multi-host start-up: ``jax.distributed.initialize`` from flags, environment or the cluster.

Where the coordinator comes from, first match wins:

1. explicit arguments (``train.py --coordinator_address=host:port --num_processes=N
   --process_id=I``);
2. the environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
   ``JAX_PROCESS_ID`` (any launcher can set them);
3. a detected cluster: SLURM (``srun``), Open MPI (``mpirun``) and Cloud TPU pod slices, which
   ``jax.distributed.initialize()`` configures by itself;
4. otherwise a single process: nothing is initialised.

On CPU the processes talk through gloo collectives (set before initialisation). Call this
before anything touches a JAX device.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _int_env(name: str) -> Optional[int]:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"environment variable {name}={value!r} is invalid: expected an integer >= 0")
    return int(value)


def detected_cluster() -> Optional[str]:
    """The multi-process launcher this process runs under ('slurm', 'mpi', 'tpu'), if any."""
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in os.environ:
        return "slurm"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "mpi"
    if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
        return "tpu"
    return None


def initialize(coordinator_address: str = "", num_processes: Optional[int] = None,
               process_id: Optional[int] = None) -> str:
    """Join (or skip) a multi-process run; returns how: 'flags', 'env', a cluster name, or
    'single'. CPU collectives are set to gloo (it only affects CPU devices)."""
    how = "flags" if coordinator_address else None
    if how is None and os.environ.get("JAX_COORDINATOR_ADDRESS"):
        how = "env"
        coordinator_address = os.environ["JAX_COORDINATOR_ADDRESS"]
        num_processes = num_processes if num_processes is not None else _int_env(_ENV[1])
        process_id = process_id if process_id is not None else _int_env(_ENV[2])
    if how is not None and (num_processes is None or process_id is None):
        raise ValueError(f"a coordinator address ({coordinator_address}) needs the number of "
                         f"processes and this process's id: pass --num_processes and --process_id "
                         f"(or set {_ENV[1]} and {_ENV[2]})")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"--process_id={process_id} is invalid: expected 0 <= process_id < "
                         f"num_processes={num_processes}")
    cluster = detected_cluster() if how is None else None
    if how is None and cluster is None and (num_processes not in (None, 1)
                                            or process_id not in (None, 0)):
        raise ValueError(f"--num_processes={num_processes} --process_id={process_id} without a "
                         f"coordinator: pass --coordinator_address=HOST:PORT (or set "
                         f"{_ENV[0]}), or drop them to run as one process")
    if how is None and cluster is None:
        return "single"
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if how is None:
        jax.distributed.initialize()
        return cluster
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return how
