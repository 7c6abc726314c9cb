"""Dropless dispatch's grouped matmul on CPU: the C++ kernel against the alternatives, and the
training step with capacity dispatch against dropless dispatch on the kernel, side by side.

Table 1 (one grouped matmul at an MoE layer's shape: T * K rows over N experts of d x d_r,
forward and forward + backward): the kernel ('cpu_gmm'), XLA's batched einsum over N equal
groups (the same FLOPs: "matmul speed"), the same einsum over capacity buffers (the capacity
path's matmul, capacity_factor x the rows) and, with --ragged_dot, XLA's ``ragged_dot`` (slow:
about a minute at MoE-s size). Table 2 (with --model): a full AdamW training step of the model
(benchmarks/step_throughput.py's ``step_time``) with capacity dispatch and with dropless
dispatch on each grouped matmul, in alternating rounds, each keeping its best time. Between
them, the kernel's three custom calls alone, and the dense weight gradient x^T dy at the DAG
module's projection shapes (T * K rows into [d, d_g] and [d_g, 4 d_g]; T rows into [d_g, d]),
and at two every MoE step has (T rows into the router's [d, N] and attention's W_o [d, d]):
XLA's against the kernel's ``DagmoeWgrad`` (``cpu_weight_gradient``).

    python -m benchmarks.grouped_matmul                                  # MoE-s shapes, table 1
    python -m benchmarks.grouped_matmul --model models/s.gin --rounds 2  # and the MoE-s step
    python -m benchmarks.grouped_matmul --ragged_dot                     # and ragged_dot too
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dagmoe_jax.run.gin import load_execution_config, load_model_config
from dagmoe_jax.kernels.grouped_matmul import (cpu_grouped_matmul,
                                               cpu_weight_gradient, grouped_matmul_unavailable)
from benchmarks.step_throughput import best_alternating, step_time, time_fn


def matmul_table(tokens: int, top_k: int, experts: int, d: int, hidden: int,
                 capacity_factor: float, repeats: int, ragged: bool) -> list:
    """Rows (name, forward s, forward + backward s) of one [T * K, d] x [N, d, d_r] grouped
    matmul by each route (module docstring); the kernel's rows are timed first and last, and
    keep the better time, so drift of the shared machine does not favour it."""
    rng = np.random.default_rng(0)
    m = tokens * top_k
    sizes = jnp.asarray(np.bincount(rng.integers(0, experts, m), minlength=experts), jnp.int32)
    cap = math.ceil(capacity_factor * m / experts)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((experts, d, hidden)) / math.sqrt(d), jnp.float32)
    routes = {
        "cpu_gmm (kernel)": (lambda x, w: cpu_grouped_matmul(x, w, sizes), x),
        "einsum, equal groups": (lambda x, w: jnp.einsum("gck,gkn->gcn", x, w),
                                 x[: m // experts * experts].reshape(experts, -1, d)),
        f"einsum, capacity {capacity_factor:g}": (
            lambda x, w: jnp.einsum("gck,gkn->gcn", x, w),
            jnp.resize(x, (experts * cap, d)).reshape(experts, cap, d)),
    }
    if ragged:
        routes["ragged_dot"] = (lambda x, w: jax.lax.ragged_dot(x, w, sizes), x)
    times = {}
    order = list(routes) + [next(iter(routes))]
    for name in order:
        fn, operand = routes[name]
        fwd = jax.jit(fn)
        both = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w) ** 2), argnums=(0, 1)))
        reps = 1 if name == "ragged_dot" else repeats
        t = (time_fn(lambda: jax.block_until_ready(fwd(operand, w)), reps),
             time_fn(lambda: jax.block_until_ready(both(operand, w)), reps))
        old = times.get(name, t)
        times[name] = (min(old[0], t[0]), min(old[1], t[1]))
    return [(name, *t) for name, t in times.items()]


def products_table(tokens: int, top_k: int, experts: int, d: int, hidden: int,
                   repeats: int) -> list:
    """Rows (name, s) of the kernel's three custom calls alone at the grouped matmul's shape
    (forward, input gradient, weight gradient) and of the float32 2048^3 matmul, timed in
    alternating rounds, each keeping its best."""
    from dagmoe_jax.kernels.grouped_matmul import _call  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    m = tokens * top_k
    sizes = jnp.asarray(np.bincount(rng.integers(0, experts, m), minlength=experts), jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((experts, d, hidden)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, hidden)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((2048, 2048)), jnp.float32)
    calls = {     # operands passed in: closed-over arrays would be constant-folded
        "forward x_g W_g": (jax.jit(lambda x, w, s: _call("dagmoe_gmm", (m, hidden), x, w, s)),
                            (x, w, sizes)),
        "input grad dy_g W_g^T": (
            jax.jit(lambda dy, w, s: _call("dagmoe_gmm_t", (m, d), dy, w, s)), (dy, w, sizes)),
        "weight grad x_g^T dy_g": (
            jax.jit(lambda x, dy, s: _call("dagmoe_tgmm", (experts, d, hidden), x, dy, s)),
            (x, dy, sizes)),
        "matmul 2048^3": (jax.jit(lambda a: a @ a), (a,)),
    }
    return list(best_alternating({name: lambda f=f, o=o: jax.block_until_ready(f(*o))
                                  for name, (f, o) in calls.items()}, repeats).items())


def weight_gradient_table(tokens: int, top_k: int, d: int, dag_dim: int, repeats: int,
                          experts: int = 32) -> list:
    """Rows (projection [T, K]^T [T, N], XLA s, kernel s, FLOPs) of x^T dy at the DAG module's
    weight-gradient shapes and the router's and W_o's (module docstring), XLA's and the
    kernel's in alternating rounds, each keeping its best."""
    rng = np.random.default_rng(1)
    m = tokens * top_k
    shapes = {"eq. 8 W_down": (m, d, dag_dim), "eq. 9 W_pair": (m, dag_dim, 4 * dag_dim),
              "eq. 11 W_up": (m, dag_dim, d), "eq. 11-12 W_up summed": (tokens, dag_dim, d),
              "router W_router": (tokens, d, experts), "attention W_o": (tokens, d, d)}
    xla, kernel = jax.jit(lambda x, dy: x.T @ dy), jax.jit(cpu_weight_gradient)
    rows = []
    for label, (t, k, n) in shapes.items():
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
        dy = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
        best = best_alternating({name: lambda f=f: jax.block_until_ready(f(x, dy))
                                 for name, f in (("xla", xla), ("kernel", kernel))},
                                repeats)
        rows.append((f"{label} [{t}, {k}]^T [{t}, {n}]", best["xla"], best["kernel"],
                     2 * t * k * n))
    return rows


def step_table(model: str, gin: list, bindings: list, batch: int, seq: int, steps: int,
               rounds: int, ragged: bool) -> list:
    """Rows (name, s/step) of the model's training step with capacity dispatch and dropless
    dispatch on 'cpu_gmm' (and 'ragged_dot' with ``ragged``), alternating rounds."""
    variants = {"capacity": ["ExpertConfig.dispatch = 'capacity'"],
                "dropless cpu_gmm": ["ExpertConfig.dispatch = 'dropless'",
                                     "ExecutionConfig.grouped_matmul = 'cpu_gmm'"]}
    if ragged:
        variants["dropless ragged_dot"] = ["ExpertConfig.dispatch = 'dropless'",
                                           "ExecutionConfig.grouped_matmul = 'ragged_dot'"]
    best = {}
    for r in range(rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            files, named = [model, *gin], [*bindings, *variants[name]]
            cfg, execution = load_model_config(files, named), load_execution_config(files, named)
            t = step_time(cfg, execution, batch, seq, steps)
            best[name] = min(best.get(name, t), t)
            print(f"  measured {name}, round {r + 1}: {t:.3f} s/step", flush=True)
    return [(name, best[name]) for name in variants]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="T (batch x seq) of table 1")
    p.add_argument("--top_k", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256, help="expert hidden size d_r")
    p.add_argument("--capacity_factor", type=float, default=1.25)
    p.add_argument("--dag_dim", type=int, default=128, help="d_g of the weight-gradient table")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per route (best of)")
    p.add_argument("--ragged_dot", action="store_true", help="time jax.lax.ragged_dot too")
    p.add_argument("--model", help="model gin file for table 2 (e.g. models/s.gin)")
    p.add_argument("--gin", action="append", default=[], help="extra gin files, repeatable")
    p.add_argument("--binding", action="append", default=[], help="extra gin bindings")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant (best of)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    reason = grouped_matmul_unavailable()
    if reason is not None:
        sys.exit(f"the CPU grouped matmul cannot run here: {reason}")

    rows = matmul_table(args.tokens, args.top_k, args.experts, args.d_model, args.hidden,
                        args.capacity_factor, args.repeats, args.ragged_dot)
    m = args.tokens * args.top_k
    flops = 2 * m * args.d_model * args.hidden
    print(f"grouped matmul [{m}, {args.d_model}] x [{args.experts}, {args.d_model}, "
          f"{args.hidden}] ({jax.devices()[0].device_kind}, best of {args.repeats})")
    print(f"{'route':<24}{'fwd s':>9}{'fwd+bwd s':>11}{'GFLOP/s':>9}{'vs kernel':>11}")
    kernel = rows[0]
    for name, fwd, both in rows:
        print(f"{name:<24}{fwd:>9.4f}{both:>11.4f}{3 * flops / both / 1e9:>9.1f}"
              f"{both / kernel[2]:>10.2f}x")
    print("(GFLOP/s counts the dropless FLOPs, 3 x 2 M d d_r, for every route; 'vs kernel' is "
          "the forward + backward time over the kernel's)\n")
    products = products_table(args.tokens, args.top_k, args.experts, args.d_model, args.hidden,
                              args.repeats)
    rate = 2 * 2048 ** 3 / dict(products)["matmul 2048^3"]
    print(f"{'the kernel alone':<24}{'s':>9}{'GFLOP/s':>9}{'of matmul':>11}")
    for name, t in products:
        gflops = (2 * 2048 ** 3 if name.startswith("matmul") else flops) / t / 1e9
        print(f"{name:<24}{t:>9.4f}{gflops:>9.1f}{gflops * 1e9 / rate:>10.1%}")
    print(f"\n{'dense weight grad x^T dy':<52}{'XLA s':>9}{'kernel s':>10}{'XLA':>8}"
          f"{'kernel':>8}{'XLA/kernel':>12}")
    for shape, xla, kernel, fl in weight_gradient_table(args.tokens, args.top_k, args.d_model,
                                                        args.dag_dim, args.repeats, args.experts):
        print(f"{shape:<52}{xla:>9.4f}{kernel:>10.4f}{fl / xla / rate:>8.1%}"
              f"{fl / kernel / rate:>8.1%}{xla / kernel:>11.2f}x")
    print("(XLA, kernel: each one's rate as a share of the 2048^3 matmul's)\n")
    if args.model:
        bindings = [*args.binding, f"ModelConfig.vocab_size = {args.vocab}"]
        steps = step_table(args.model, args.gin, bindings, args.batch, args.seq, args.steps,
                           args.rounds, args.ragged_dot)
        print(f"\ntraining step, {args.model}, batch {args.batch} x {args.seq}, vocab "
              f"{args.vocab} (best of {args.steps} steps x {args.rounds} rounds)")
        print(f"{'dispatch':<24}{'s/step':>9}{'vs capacity':>13}")
        for name, t in steps:
            print(f"{name:<24}{t:>9.3f}{t / steps[0][1]:>12.3f}x")


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    main()
