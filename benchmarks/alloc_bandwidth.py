"""How fast XLA:CPU writes fresh output buffers under this process's allocator.

Every call of a jitted function gets new output and temporary buffers. glibc's malloc serves
large ones with ``mmap`` and returns them on free, so each call page-faults them in again;
TCMalloc, and glibc tuned by ``mallopt``, keep freed memory for reuse. This prints the bandwidth
of an elementwise write (``x * 2 + 1``) and of a reduction (reads only) at a few buffer sizes.
Compare

    python -m benchmarks.alloc_bandwidth          # TCMalloc when installed, else glibc tuned
    DAGMOE_TCMALLOC=0 DAGMOE_GLIBC_TUNE=0 python -m benchmarks.alloc_bandwidth   # glibc as it comes

(this is what ``dagmoe_jax/run/allocator.py`` and docs/training.md's CPU notes rest on).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from dagmoe_jax.run.allocator import allocator
from benchmarks.step_throughput import time_fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, nargs="+", default=[16, 128, 256], help="buffer sizes in MB")
    p.add_argument("--repeats", type=int, default=5, help="timed calls, best of")
    args = p.parse_args(argv)
    write = jax.jit(lambda x: x * 2 + 1)
    read = jax.jit(jnp.max)
    print(f"allocator: {allocator()}\n")
    print("| buffer | write GB/s (x * 2 + 1) | read GB/s (max) |")
    print("|---:|---:|---:|")
    for mb in args.mb:
        x = jnp.ones((mb << 18,), jnp.float32)           # mb MiB of float32
        t_write = time_fn(lambda: write(x).block_until_ready(), args.repeats)
        t_read = time_fn(lambda: read(x).block_until_ready(), args.repeats)
        nbytes = x.size * 4
        print(f"| {mb} MB | {2 * nbytes / t_write / 1e9:.1f} | {nbytes / t_read / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    sys.exit(main())
