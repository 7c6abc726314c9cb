"""DUME ablations (seed 004 sec. 3 and Appendix A) and DAG upcycling that trains.

Same domains, seed model and experts as ``benchmarks/dume.py`` (its ``Bench``); per seed:

* lambda sweep: DUME k 1 solved with lambda in LAMBDAS from one statistics pass;
* k beyond 2: DUME at k 1, 2 and 3 (three domains);
* statistics tokens per row: rows of ``--stats_seq_len`` (1024) tokens, only the first 16,
  128, 512 or 1024 of each counting (the models train on 128-token rows: positions past 128
  are outside what they saw, a confound of this scale);
* upcycling into DAG-MoE, from DUME k 2, each trained ``--router_steps`` at lr 1e-3 on the mix:
  DUME+ (router only); the DAG aggregator only, at the model's ``init_std`` (W_up 0: inert)
  and with ``fan_in`` messages (``upcycle_to_dag(fan_in=True)``); a parameter-matched shared
  expert only (``add_shared_expert``, zero w_down, fan-in w_gate / w_up); and every parameter
  fine-tuned (lr 3e-4) from DUME k 2 and from the fan-in DAG, as ``benchmarks/dume.py``'s last
  pair.

Scores as ``benchmarks/dume.py``: ``100 * PPL_expert(d) / PPL_method(d)``, averaged over domains.

    python -m benchmarks.dume_ablations            # 3 seeds
    python -m benchmarks.dume_ablations --micro    # a quick end-to-end check
    python -m benchmarks.dume_ablations --report runs/bench_dume_ablations/dume_ablations.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from benchmarks.common import (add_budget_flags, fill_budget_defaults, paired_by_seed,
                               report_or_run)
from benchmarks import dume as bench_dume

DEFAULTS = dict(bench_dume.DEFAULTS, stats_seq_len=1024, stats_rows=16, dag_dim=32,
                out="runs/bench_dume_ablations")
MICRO = dict(bench_dume.MICRO, stats_seq_len=64, stats_rows=2, out="runs/bench_dume_abl_micro")
LAMBDAS = (1e-4, 1e-2, 1.0, 1e2, 1e4)
TOKENS = (16, 128, 512, 1024)
PAIRS = (("dag_aggregator_fan_in", "dume_k2"), ("dag_aggregator_fan_in", "dume_plus"),
         ("dag_aggregator_fan_in", "shared_expert"), ("dag_aggregator_init_std", "dume_k2"),
         ("dag_fan_in_finetuned", "dume_k2_finetuned"), ("dume_k3", "dume_k2"))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro", action="store_true")
    p.add_argument("--report", default="")
    p.add_argument("--json", default="")
    add_budget_flags(p, DEFAULTS)
    args = p.parse_args(argv)
    fill_budget_defaults(args, DEFAULTS, MICRO)
    return args


def long_statistics(bench, moe, seq_len, limits):
    """Per-domain statistics from rows of ``seq_len`` tokens (``stats_rows`` rows per domain)
    for each first-n-tokens limit in ``limits``: {limit: [DomainStatistics per domain]}."""
    import jax.numpy as jnp
    from dagmoe_jax.upcycle.dume import forced_forward, token_mask
    from dagmoe_jax.upcycle.ridge import DomainStatistics

    cfg = moe.cfg
    out = {t: [] for t in limits}
    for d in range(len(bench.domains)):
        stats = {t: DomainStatistics.zeros(cfg.num_layers, cfg.d_model) for t in limits}
        data = dataclasses.replace(bench.base, source=bench.domains[d][1], seed=99,
                                   seq_len=seq_len, batch_size=bench.args.stats_rows)
        for b in bench.batches(data, n=1):
            _, x = forced_forward(moe, jnp.asarray(b["inputs"]), jnp.int32(d), head=False)
            x = np.asarray(x, np.float64).reshape(cfg.num_layers, -1, cfg.d_model)
            for t in limits:
                stats[t].update(x, token_mask(b, t).reshape(-1))
        for t in limits:
            out[t].append(stats[t])
    return out


def run_seed(bench, seed):
    from flax import nnx
    from dagmoe_jax.families.moe.budget import matched_shared_hidden
    from dagmoe_jax.model import Transformer
    from dagmoe_jax.model.settle import settle
    from dagmoe_jax.upcycle import dume, moerge

    a, log = bench.args, bench.log
    n = len(bench.domains)
    sources = [train for _, train, _ in bench.domains]
    t0 = time.perf_counter()
    seed_model = bench.train(Transformer(bench.cfg, execution=settle(bench.cfg),
                                         rngs=nnx.Rngs(seed)),
                             bench.data(sources, seed), a.seed_steps, 3e-3)
    experts = [bench.train(nnx.clone(seed_model), bench.data([s], seed), a.expert_steps, 1e-3)
               for s in sources]
    log(f"seed {seed}: seed model and {n} experts trained ({time.perf_counter() - t0:.0f} s)")
    ce = {f"expert_{j}": bench.ces(e) for j, e in enumerate(experts)}
    cfgs = {k: moerge.dume_config(bench.cfg, n, top_k=k) for k in range(1, n + 1)}
    merged = {k: moerge.moerge(experts, c, execution=settle(c), seed=seed)
              for k, c in cfgs.items()}
    stats = bench_dume.statistics(bench, merged[1], range(n), (None,))[None]
    for k in cfgs:
        ce[f"dume_k{k}"] = bench.ces(dume.dume(merged[k], stats))
    lam = {str(v): bench.ces(dume.dume(nnx.clone(merged[1]), stats, v)) for v in LAMBDAS}
    limits = [t for t in TOKENS if t <= a.stats_seq_len]
    long = long_statistics(bench, merged[1], a.stats_seq_len, limits)
    tokens = {str(t): bench.ces(dume.dume(nnx.clone(merged[1]), long[t])) for t in limits}
    log(f"seed {seed}: ablations done ({time.perf_counter() - t0:.0f} s)")
    base, mixed = merged[2], bench.data(sources, seed + 1000)
    steps = a.router_steps
    ce["dume_plus"] = bench.ces(bench.train(nnx.clone(base), mixed, steps, 1e-3, "router"))
    for name, fan_in in (("init_std", False), ("fan_in", True)):
        dag = dume.upcycle_to_dag(nnx.clone(base), dag_dim=a.dag_dim, dag_iters=2, seed=seed,
                                  fan_in=fan_in)
        ce[f"dag_aggregator_{name}"] = bench.ces(bench.train(dag, mixed, steps, 1e-3,
                                                             "aggregator"))
    hidden = matched_shared_hidden(bench.cfg.d_model, a.dag_dim, 2)
    shared = dume.add_shared_expert(nnx.clone(base), hidden, seed=seed, fan_in=True)
    ce["shared_expert"] = bench.ces(bench.train(shared, mixed, steps, 1e-3, "shared"))
    ce["dume_k2_finetuned"] = bench.ces(bench.train(nnx.clone(base), mixed, steps, 3e-4, "all"))
    dag = dume.upcycle_to_dag(nnx.clone(base), dag_dim=a.dag_dim, dag_iters=2, seed=seed,
                              fan_in=True)
    ce["dag_fan_in_finetuned"] = bench.ces(bench.train(dag, mixed, steps, 3e-4, "all"))
    log(f"seed {seed}: done ({time.perf_counter() - t0:.0f} s)")
    return {"ce": ce, "lambda": lam, "tokens": tokens, "shared_hidden": hidden}


def summarise(per_seed, domains):
    n = len(domains)
    own = np.array([[s["ce"][f"expert_{d}"][d] for d in range(n)] for s in per_seed])

    def average(ces):                    # [S, D] -> (mean, std over seeds) of the domain mean
        sc = (100.0 * np.exp(own - np.asarray(ces))).mean(1)
        return float(sc.mean()), float(sc.std())

    out = {"domains": [d[0] for d in domains]}
    for key in ("ce", "lambda", "tokens"):
        out[key] = {m: average([s[key][m] for s in per_seed]) for m in per_seed[0][key]}
    return out


def format_report(results):
    s = results["summary"]
    lines = [f"DUME ablations and DAG upcycling: {results['seeds']} seeds; average score = 100 * "
             f"PPL_expert(d) / PPL_method(d) over {', '.join(s['domains'])} (mean ± std)"]
    for key, title in (("ce", "method"), ("lambda", "DUME k 1, ridge lambda"),
                       ("tokens", "DUME k 1, statistics tokens per row")):
        lines.append(f"{title:<40}{'average':>16}")
        for m, (v, e) in s[key].items():
            if not m.startswith("expert_"):
                lines.append(f"  {m:<38}{v:>9.1f} ± {e:<4.1f}")
    lines.append(f"shared expert hidden {results['per_seed'][0]['shared_hidden']} (the DAG's "
                 f"parameters); paired by seed, domain-mean cross-entropy, method - baseline "
                 f"(nats/byte):")
    lines += paired_by_seed(results["per_seed"], PAIRS)
    return "\n".join(lines)


def run(args, out, log):
    from dagmoe_jax.config import ModelConfig
    from dagmoe_jax.families.dense.config import DenseConfig
    from benchmarks.experiments.corpus import (build_c_header_corpus, build_manpage_corpus,
                                               build_stdlib_corpus, corpus_sources)
    domains = []
    for name, build in (("stdlib_docs", build_stdlib_corpus), ("manpages", build_manpage_corpus),
                        ("c_headers", build_c_header_corpus)):
        train, held = corpus_sources(build(out / "corpus"))
        domains.append((name, train, held))
    bench = bench_dume.Bench(args, domains, log)
    d = args.d_model
    bench.cfg = ModelConfig(vocab_size=256, d_model=d, num_layers=args.layers,
                            num_heads=4, num_kv_heads=2, block=DenseConfig(ffn_hidden=3 * d),
                            max_seq_len=max(args.seq_len, args.stats_seq_len, 64),
                            rope_theta=10000.0)
    per_seed = [run_seed(bench, seed) for seed in range(args.seeds)]
    return {"seeds": args.seeds, "budget": {k: getattr(args, k) for k in DEFAULTS},
            "per_seed": per_seed, "summary": summarise(per_seed, domains)}


def main(argv=None) -> int:
    return report_or_run(parse_args(sys.argv[1:] if argv is None else argv), "dume_ablations.json", run,
                         format_report)


if __name__ == "__main__":
    sys.exit(main())
