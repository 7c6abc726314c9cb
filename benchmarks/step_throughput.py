"""Training-step throughput of the paper's s-size variants, side by side in one run.

For each variant (MoE, MoE + shared expert, DAG-MoE L 1/2/3, MLP mixing, CoE) at each vocabulary
size it times a full AdamW training step (forward + backward + update) and reports tokens/s,
model FLOP/s from :mod:`dagmoe_jax.model.accounting` and their ratio to this machine's float32 matmul
rate, measured in the same run. A second table times the DAG module against the experts it
aggregates (forward + backward) to compare their achieved FLOP/s.

    python -m benchmarks.step_throughput                       # full run (CPU: ~20 minutes)
    python -m benchmarks.step_throughput --vocab 256 --steps 2 # quicker
    # the DAG-MoE vs MoE + shared comparison at 128K, each variant at both ends of the process
    python -m benchmarks.step_throughput --vocab 128256 --variants moe+shared "dag L2" --rounds 2
    # the CPU defaults' ablation: the previous defaults, each process timed on its own
    DAGMOE_TCMALLOC=0 python -m benchmarks.step_throughput --vocab 256 --variants moe \
        --binding "ExecutionConfig.remat = 'full'" --binding "ExecutionConfig.scan_unroll = 1" \
        --binding "ExecutionConfig.attention_block = 32"
    # the GPU measurement of the l model (bf16, cuDNN attention; MFU vs the bf16 matmul rate)
    python -m benchmarks.step_throughput --model models/l.gin --gin gpu.gin --dag_dim 256 \
        --vocab 128256 --batch 16 --seq 2048 --variants moe moe+shared "dag L2"
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dagmoe_jax.model.accounting import account
from dagmoe_jax.run.gin import load_execution_config, load_model_config
from dagmoe_jax.run.allocator import allocator, release_memory
from dagmoe_jax.model import Transformer
from dagmoe_jax.families.moe.dag import DAGAggregator
from dagmoe_jax.model.settle import describe as describe_settled
from dagmoe_jax.model.settle import settle
from dagmoe_jax.model.routed.experts import Experts
from dagmoe_jax.train.step import make_train_step

VARIANTS = {
    "moe": "variants/moe.gin",
    "moe+shared": "variants/moe_shared_g{g}_l2.gin",
    "dag L1": "variants/dag_g{g}_l1.gin",
    "dag L2": "variants/dag_g{g}_l2.gin",
    "dag L3": "variants/dag_g{g}_l3.gin",
    "mlp g64": "variants/mlp_g64.gin",
    "coe c2 g128": "variants/coe_g128_l2.gin",
}
BASELINE = "moe+shared"


def time_fn(fn, repeats: int) -> float:
    """Best wall time of ``fn()`` (which must block) over ``repeats`` calls after a warm-up.

    The minimum, not the median: on a shared machine interference only ever adds time."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.min(times))


def best_alternating(fns: dict, repeats: int, rounds: int = 4) -> dict:
    """{name: best time} of each blocking ``fns[name]()`` by :func:`time_fn`, over ``rounds``
    passes with odd passes in reverse order, so that the machine's drift reaches all alike."""
    names, best = list(fns), {}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time_fn(fns[name], repeats)
            best[name] = min(best.get(name, t), t)
    return {name: best[name] for name in names}


def matmul_rate(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """Measured FLOP/s of an n x n x n matmul in ``dtype`` on the default device."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / time_fn(lambda: f(a, a).block_until_ready(), repeats)


def load(files, bindings=()):
    """(ModelConfig, ExecutionConfig): what the gin ``files`` and ``bindings`` describe."""
    return load_model_config(files, bindings), load_execution_config(files, bindings)


def train_step(cfg, execution, batch: int, seq: int):
    """(step, model, optimizer, data): the jitted AdamW training step of ``cfg`` run as
    ``execution`` (settled here) on a fixed batch of random tokens; ``step(model, optimizer,
    data)`` runs one step."""
    model = Transformer(cfg, execution=settle(cfg, execution), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq + 1)), jnp.int32)
    return make_train_step(), model, optimizer, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def step_time(cfg, execution, batch: int, seq: int, steps: int, faults=None) -> float:
    """Best time of ``steps`` timed training steps (after a warm-up); ``faults``: a list that
    gets the fewest minor page faults one timed step took (a step that faults its buffers in
    again every time is slowed by the allocator, not its arithmetic)."""
    step, model, optimizer, data = train_step(cfg, execution, batch, seq)
    counts = []

    def one():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(step(model, optimizer, data))
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    t = time_fn(one, steps)
    if faults is not None:
        faults.append(min(counts[1:]))            # the warm-up call excluded
    return t


def component_rates(cfg, execution, tokens: int, repeats: int):
    """Achieved FLOP/s (forward + backward) of the experts (dispatch included) and of the DAG
    module, both run as ``execution`` (settled here), on random inputs of ``tokens`` tokens."""
    d, k, e = cfg.d_model, cfg.block.router.top_k, cfg.block.experts
    rngs, settled = nnx.Rngs(0), settle(cfg, execution)
    experts = Experts(e, d, std=cfg.init_std, dtype=jnp.float32, execution=settled, rngs=rngs)
    dag = DAGAggregator(cfg.block.aggregation, d, std=cfg.init_std, eps=cfg.norm_eps,
                        execution=settled, rngs=rngs)
    w_up = dag.iterations.w_up  # random, so the backward pass is not trivially zero
    w_up[...] = 0.02 * jax.random.normal(jax.random.key(1), w_up.shape)
    x = jax.random.normal(jax.random.key(2), (tokens, d))
    idx = jnp.asarray(np.argsort(np.random.default_rng(0).random((tokens, e.num_experts)), 1)[:, :k])
    gates = jax.random.uniform(jax.random.key(3), (tokens, k))
    out = jax.random.normal(jax.random.key(4), (tokens, k, d))

    # Gradients of every float input too, as inside a model: without x's, the experts skipped
    # their input-gradient products (2 of their 9) and read 1.3x faster than they run in a step.
    @nnx.jit
    def experts_step(m, x):
        return nnx.grad(lambda m, x: jnp.sum(m(x, idx)[0] ** 2), argnums=(0, 1))(m, x)

    @nnx.jit
    def dag_step(m, x, g, o):
        return nnx.grad(lambda m, x, g, o: jnp.sum(m(x, g, o)[0] ** 2),
                        argnums=(0, 1, 2, 3))(m, x, g, o)

    t_exp = time_fn(lambda: jax.block_until_ready(experts_step(experts, x)), repeats)
    t_dag = time_fn(lambda: jax.block_until_ready(dag_step(dag, x, gates, out)), repeats)
    acc = account(cfg)
    per_tok = acc.flops
    flops_exp = per_tok["experts"] / cfg.num_layers * tokens
    flops_dag = (per_tok["aggregator"] + per_tok["dag_pairwise"]) / cfg.num_layers * tokens
    return t_exp, flops_exp / t_exp, t_dag, flops_dag / t_dag


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/s.gin", help="model-size gin file")
    p.add_argument("--gin", action="append", default=[],
                   help="extra gin files after model + variant (e.g. gpu.gin), repeatable")
    p.add_argument("--dag_dim", type=int, default=128, choices=(64, 128, 256),
                   help="d_g of the DAG variants; the shared expert is matched to d_g, L 2 "
                        "(the paper: 128 for s and m, 256 for l)")
    p.add_argument("--binding", action="append", default=[],
                   help="extra gin binding for every variant, repeatable (e.g. "
                        "\"ExecutionConfig.remat = 'full'\")")
    p.add_argument("--vocab", type=int, nargs="+", default=[256, 128256])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (best of)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds over the variants, every other one in reverse order; each "
                        "variant keeps its best (2 puts every variant at both ends of the run)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--components-only", action="store_true", help="only the DAG vs experts table")
    args = p.parse_args(argv)
    if args.components_only:
        args.vocab = []

    probe, probe_execution = load([args.model, *args.gin])
    dtype = jnp.dtype(probe.compute_dtype)
    n = 2048 if jax.devices()[0].platform == "cpu" else 8192
    rate = lambda: matmul_rate(n, dtype=dtype)  # noqa: E731
    peak = rate()
    settled = settle(probe, probe_execution, log=print)
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  "
          f"{dtype.name} {n}^3 matmul: {peak / 1e9:.1f} GFLOP/s  allocator: {allocator()}  "
          f"model: {describe_settled(probe, settled, probe_execution)}")
    print(f"batch {args.batch} x {args.seq} tokens, best of {args.steps} timed steps per variant"
          f"{f' and of {args.rounds} rounds' if args.rounds > 1 else ''}\n")
    tokens = args.batch * args.seq
    tables = {}
    for vocab in args.vocab:
        runs = {name: load([args.model, VARIANTS[name].format(g=args.dag_dim), *args.gin],
                           [*args.binding, f"ModelConfig.vocab_size = {vocab}"])
                for name in args.variants}
        best = {}
        for r in range(args.rounds):
            # Odd rounds go in reverse: a variant's position in the process matters (memory
            # state after the models before it), so two rounds give each variant both ends.
            for name in (args.variants if r % 2 == 0 else args.variants[::-1]):
                faults = []
                t = step_time(*runs[name], args.batch, args.seq, args.steps, faults)
                release_memory()
                peak = max(peak, rate())  # the machine's speed drifts: keep the best rate seen
                best[name] = min(best.get(name, t), t)
                print(f"  measured {name} @ vocab {vocab}, round {r + 1}: {t:.3f} s/step, "
                      f"{faults[0]:,} minor page faults a step", flush=True)
        rows = tables[vocab] = []
        for name in args.variants:
            acc, t = account(runs[name][0], args.seq), best[name]
            rows.append((name, acc.total_params, t, tokens / t, acc.train_flops_per_token * tokens / t))
    print(f"\nhighest {dtype.name} matmul rate seen in this run: {peak / 1e9:.1f} GFLOP/s "
          f"('of matmul', i.e. MFU against the measured rate, divides by it)")
    for vocab, rows in tables.items():
        base = {r[0]: r for r in rows}.get(BASELINE)
        print(f"\nvocab {vocab}")
        print(f"{'variant':<18}{'params':>14}{'s/step':>9}{'tokens/s':>10}{'GFLOP/s':>9}"
              f"{'of matmul':>11}{'step vs ' + BASELINE:>26}")
        for name, params, t, tps, fps in rows:
            ratio = f"{t / base[2]:.3f}x" if base else "-"
            print(f"{name:<18}{params:>14,}{t:>9.3f}{tps:>10,.0f}{fps / 1e9:>9.1f}"
                  f"{fps / peak:>10.1%}{ratio:>26}")
    print()

    cfg, execution = load([args.model, f"variants/dag_g{args.dag_dim}_l2.gin", *args.gin],
                          args.binding)
    t_exp, r_exp, t_dag, r_dag = component_rates(cfg, execution, tokens, max(args.steps, 3))
    print(f"components (one layer, {tokens} tokens, forward + backward)")
    print(f"{'component':<28}{'s':>9}{'GFLOP/s':>10}{'vs experts':>12}")
    experts = f"experts ({cfg.block.experts.dispatch} dispatch)"
    print(f"{experts:<28}{t_exp:>9.4f}{r_exp / 1e9:>10.1f}{1.0:>11.2f}x")
    print(f"{f'DAG module d_g {args.dag_dim} L 2':<28}{t_dag:>9.4f}{r_dag / 1e9:>10.1f}{r_dag / r_exp:>11.2f}x")


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    main()
