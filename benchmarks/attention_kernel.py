"""Causal attention implementations side by side: forward and forward + backward time of one
layer's attention core (no projections), in one run, with ratios against the fused kernel.

Default shape: the s model's (batch 8 x 512 tokens, 32 query heads over 8 KV heads, head_dim
16). The implementations are ``ExecutionConfig.attention``'s: 'fused' (the C++ kernel of
``dagmoe_jax/kernels``, CPU only), 'blockwise' (XLA, ``ExecutionConfig.attention_block`` keys per
block) and 'xla' (``jax.nn.dot_product_attention``). Rounds alternate between them and each
keeps its best time, so machine drift hits all alike.

    python -m benchmarks.attention_kernel
    python -m benchmarks.attention_kernel --heads 8 --kv 8 --head_dim 64   # another shape
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from dagmoe_jax.kernels import fused_attention_unavailable
from dagmoe_jax.run.allocator import allocator
from dagmoe_jax.model.attention import causal_attention
from benchmarks.step_throughput import time_fn

IMPLS = ("fused", "blockwise", "xla")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv", type=int, default=8, help="KV heads (a divisor of --heads)")
    p.add_argument("--head_dim", type=int, default=16)
    p.add_argument("--block", type=int, default=64, help="the blockwise attention's block")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds, best of")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    args = p.parse_args(argv)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    reason = fused_attention_unavailable(shape)
    impls = [i for i in args.impls if i != "fused" or reason is None]
    if len(impls) < len(args.impls):
        print(f"fused kernel skipped: {reason}")
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], shape)
    k, v = (jax.random.normal(kk, (args.batch, args.seq, args.kv, args.head_dim))
            for kk in keys[1:3])
    cot = jax.random.normal(keys[3], shape)
    fns = {}
    for impl in impls:
        attend = lambda q, k, v, impl=impl: causal_attention(q, k, v, impl, args.block)
        fwd = jax.jit(attend)
        grad = jax.jit(jax.grad(lambda q, k, v, f=attend: jnp.sum(f(q, k, v) * cot),
                                argnums=(0, 1, 2)))
        fns[impl] = (lambda f=fwd: f(q, k, v).block_until_ready(),
                     lambda g=grad: jax.block_until_ready(g(q, k, v)))
    best = {impl: [float("inf"), float("inf")] for impl in impls}
    for _ in range(args.rounds):
        for impl in impls:
            for i, fn in enumerate(fns[impl]):
                best[impl][i] = min(best[impl][i], time_fn(fn, 1))
    print(f"device: {jax.devices()[0].device_kind}  allocator: {allocator()}")
    print(f"batch {args.batch} x {args.seq}, {args.heads} heads / {args.kv} KV heads, head_dim "
          f"{args.head_dim}; best of {args.rounds} alternating rounds\n")
    base = impls[0]
    print(f"| attention | forward ms | forward + backward ms | fwd+bwd vs {base} |")
    print("|---|---:|---:|---:|")
    for impl in impls:
        f, fb = best[impl]
        # 3 significant digits: at tiny test shapes a step takes well under 0.1 ms
        print(f"| {impl} | {f * 1e3:.3g} | {fb * 1e3:.3g} | {fb / best[base][1]:.2f}x |")
    return 0


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    sys.exit(main())
