"""Where the DAG module's time goes, equation by equation, against its FLOPs at the matmul rate.

At one layer of the paper's s model (T = batch x seq tokens, K = top-k nodes, d, d_g, L) it
times each of DAG-MoE eq. 6-12 alone, forward + backward (the vector-Jacobian product of a
random cotangent, which runs the forward too), on random inputs of the shapes the module
feeds it, then the whole module as XLA alone runs it ('xla') and as the library runs it on
CPU ('fused': the C++ kernels for eq. 7's LayerNorm and eq. 10's pairwise messages, and the
weight gradients of eq. 8, 9 and 11's projections), and the routed experts of the same layer.
Each row prints its matmul FLOPs (forward + backward = 3x forward) and the time those would
take at this machine's float32 matmul rate measured in the same run; the elementwise rows
have no matmul FLOPs, so their whole time is overhead against that ideal.

    python -m benchmarks.dag_module                          # s shape: 8 x 512 tokens, L 2
    python -m benchmarks.dag_module --iters 3 --rounds 3

Rows are timed in alternating order over ``--rounds`` (odd rounds reversed) and each keeps
its best time, so that drift of the machine during the run reaches every row alike.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.kernels.dag_module import (dag_module_unavailable,
                                           fused_dag_messages, fused_layer_norm)
from dagmoe_jax.families.moe import dag
from dagmoe_jax.families.moe.dag import dag_execution
from dagmoe_jax.model.routed.experts import Experts
from dagmoe_jax.run.allocator import allocator
from dagmoe_jax.run.gin import load_execution_config, load_model_config
from dagmoe_jax.model.settle import settle
from benchmarks.step_throughput import matmul_rate, time_fn


def vjp_fn(fn, args):
    """(a jitted function of (cotangent, *args) that runs ``fn`` forward and back, a random
    cotangent of ``fn``'s output). The cotangent is an argument: a constant one would let XLA
    fold it into the products (a weight gradient x^T c becomes a column sum)."""
    leaves, tree = jax.tree.flatten(jax.eval_shape(fn, *args))
    keys = jax.random.split(jax.random.key(7), len(leaves))
    cot = jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, a.shape, a.dtype)
                                    for k, a in zip(keys, leaves)])

    def run(cot, *args):
        _, pullback = jax.vjp(fn, *args)
        return pullback(cot)
    return jax.jit(run), cot


def equation_rows(t: int, k: int, d: int, dg: int, edge_act: str):
    """[(name, fn, args, forward matmul FLOPs)] for eq. 6-12 of one iteration alone."""
    keys = iter(jax.random.split(jax.random.key(0), 16))
    rand = lambda *shape: 0.05 * jax.random.normal(next(keys), shape)  # noqa: E731
    x, expert_out, nodes = rand(t, d), rand(t, k, d), rand(t, k, d)
    gates = jax.random.uniform(next(keys), (t, k))
    scale, bias = jnp.ones(d), jnp.zeros(d)
    w_down, w_edge, w_node, w_up = rand(d, dg), rand(2 * dg, dg), rand(2 * dg, dg), rand(dg, d)
    u, proj, msg = rand(t, k, dg), 10 * rand(t, k, 4 * dg), rand(t, k, dg)
    flat = nodes.reshape(t * k, d)

    xla_rows, kernel = dag_execution("xla"), dag_execution("fused")

    def pair_projection(u, w_edge, w_node, ex):
        return ex.project(u.reshape(t * k, dg), dag.dag_pair_weights(w_edge, w_node))

    def both(name, fn, args, flops):
        """A projection's rows with XLA's weight gradient and with the kernel's (the DAG
        module's 'xla' and 'fused' strategies)."""
        return [(f"{name}, {how}", functools.partial(fn, ex=ex), args, flops)
                for how, ex in (("XLA", xla_rows), ("kernel", kernel))]

    def project(x, w, ex):
        return ex.project(x, w)

    return [
        ("eq. 6 initial nodes", dag.dag_initial_nodes, (x, gates, expert_out), 0),
        ("eq. 7 LayerNorm, XLA", lambda f, s, b: dag.layer_norm(f, s, b, 1e-5),
         (flat, scale, bias), 0),
        ("eq. 7 LayerNorm, kernel", lambda f, s, b: fused_layer_norm(f, s, b, 1e-5),
         (flat, scale, bias), 0),
        *both("eq. 8 W_down", project, (flat, w_down), 2 * t * k * d * dg),
        *both("eq. 9 pair projection", pair_projection, (u, w_edge, w_node),
              2 * t * k * dg * 4 * dg),
        ("eq. 10 messages, XLA", lambda p: dag.dag_pair_messages(p, edge_act), (proj,), 0),
        ("eq. 10 messages, kernel", lambda p: fused_dag_messages(p, "all", edge_act), (proj,), 0),
        *both("eq. 11 W_up per node",
              lambda m, w, ex: ex.project(m.reshape(t * k, dg), w), (msg, w_up),
              2 * t * k * dg * d),
        *both("eq. 11-12 W_up summed",
              lambda m, w, ex: ex.project(jnp.sum(m, axis=1), w), (msg, w_up),
              2 * t * dg * d),
        ("eq. 12 readout", dag.dag_readout, (nodes,), 0),
    ]


def module_row(name: str, cfg, dag_module: str, t: int):
    """(name, fn, args, forward matmul FLOPs) of the whole DAG module run as ``dag_module``
    ('xla' or 'fused'); W_up random, so that the backward pass is not trivially zero."""
    k, a = cfg.block.router.top_k, cfg.block.aggregation
    module = dag.DAGAggregator(a, cfg.d_model, std=cfg.init_std, eps=cfg.norm_eps,
                               execution=ExecutionConfig(dag_module=dag_module),
                               rngs=nnx.Rngs(0))
    w_up = module.iterations.w_up
    w_up[...] = 0.02 * jax.random.normal(jax.random.key(1), w_up.shape)
    graphdef, params = nnx.split(module)
    keys = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(keys[0], (t, cfg.d_model))
    out = jax.random.normal(keys[1], (t, k, cfg.d_model))
    gates = jax.random.uniform(keys[2], (t, k))
    fn = lambda p, x, g, o: nnx.merge(graphdef, p)(x, g, o)[0]  # noqa: E731
    d, dg, iters = cfg.d_model, a.dag_dim, a.dag_iters
    # model.accounting's count; the kernels' path applies the last W_up to the summed messages
    flops = t * iters * k * (4 * d * dg + 8 * dg * dg)
    return name, fn, (params, x, gates, out), flops


def experts_row(cfg, execution, t: int):
    """(name, fn, args, forward matmul FLOPs) of the layer's routed experts (dispatch
    included), run as ``execution`` settled for this machine."""
    e, k = cfg.block.experts, cfg.block.router.top_k
    experts = Experts(e, cfg.d_model, std=cfg.init_std, dtype=jnp.float32,
                      execution=settle(cfg, execution), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(experts)
    idx = jax.random.randint(jax.random.key(3), (t, k), 0, e.num_experts)
    x = jax.random.normal(jax.random.key(4), (t, cfg.d_model))
    fn = lambda p, x, idx: nnx.merge(graphdef, p)(x, idx)[0]  # noqa: E731
    return (f"experts ({e.dispatch}, top-{k})", fn, (params, x, idx),
            t * k * 3 * 2 * cfg.d_model * e.expert_hidden)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/s.gin", help="model-size gin file")
    p.add_argument("--dag_dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=2, help="DAG iterations L")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per row (best of)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the rows, alternating")
    args = p.parse_args(argv)

    bindings = ["AggregationConfig.kind = 'dag'", f"AggregationConfig.dag_dim = {args.dag_dim}",
                f"AggregationConfig.dag_iters = {args.iters}", "ModelConfig.vocab_size = 256"]
    cfg = load_model_config([args.model], bindings)
    execution = load_execution_config([args.model], bindings)
    t, k, d, dg = args.batch * args.seq, cfg.block.router.top_k, cfg.d_model, args.dag_dim
    a = cfg.block.aggregation
    reason = dag_module_unavailable(d, dg)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    rows = equation_rows(t, k, d, dg, a.edge_act)
    rows += [module_row(f"DAG module L {a.dag_iters}, XLA", cfg, "xla", t),
             module_row(f"DAG module L {a.dag_iters}, kernel", cfg, "fused", t),
             experts_row(cfg, execution, t)]
    fns = [vjp_fn(fn, a) for _, fn, a, _ in rows]
    rate = matmul_rate(2048)
    print(f"device: {jax.devices()[0].device_kind}  allocator: {allocator()}  float32 2048^3 "
          f"matmul: {rate / 1e9:.1f} GFLOP/s")
    print(f"one layer: T {t} tokens, K {k}, d {d}, d_g {dg}, L {a.dag_iters}, edge act "
          f"{a.edge_act}; forward + backward, best of {args.repeats} calls and {args.rounds} "
          f"rounds\n")
    best = [float("inf")] * len(rows)
    for r in range(args.rounds):
        order = range(len(rows)) if r % 2 == 0 else reversed(range(len(rows)))
        for i in order:
            run, cot = fns[i]
            sec = time_fn(lambda: jax.block_until_ready(run(cot, *rows[i][2])), args.repeats)
            best[i] = min(best[i], sec)
        rate = max(rate, matmul_rate(2048))
    print(f"{'part':<34}{'ms':>9}{'GFLOP':>8}{'ideal ms':>10}{'GFLOP/s':>9}{'of matmul':>11}")
    for (name, _, _, fwd), sec in zip(rows, best):
        flops = 3 * fwd
        ideal = flops / rate
        gfs = f"{flops / sec / 1e9:>9.1f}" if flops else f"{'-':>9}"
        share = f"{ideal / sec:>10.1%}" if flops else f"{'-':>10}"
        print(f"{name:<34}{sec * 1e3:>9.1f}{flops / 1e9:>8.2f}{ideal * 1e3:>10.1f}{gfs}{share}")
    print(f"\nhighest float32 matmul rate seen: {rate / 1e9:.1f} GFLOP/s ('of matmul' divides "
          f"by it)")
    return 0


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    sys.exit(main())
