"""DUME benchmark (seed 004, Table 2 in miniature): dense experts merged without training.

Three offline domains (nothing downloaded; benchmarks/experiments/corpus.py): the docstrings of
Python's standard library, the installed manual pages and the C headers under /usr/include.
Per seed: a dense seed model is trained on the mixed stream, three experts branch from it and
train on one domain each; then every method is scored per domain as the paper does,
``100 * PPL_expert(d) / PPL_method(d)`` with PPL_expert(d) the perplexity of domain d's own
expert, and averaged over domains:

  each expert; parameter averaging; oracle (every layer forced to the domain's expert, the
  shared weights averaged); random routing (k 1, the paper's baseline; and k 2, BTX's start);
  BTX (random router k 2, then router-only training); DUME at top_k 1 and 2; DUME+ (DUME k 2,
  then the same router-only training); DUME k 1 with the authors' trainable set (routers and
  the experts' w_gate, 'router_and_gates'; at k 1 only the w_gate move); and the DAG
  upcycling (DUME k 2 + a zero-W_up DAG aggregator) against DUME k 2, both fine-tuned on every
  parameter for the same steps.

Also per layer the routing accuracy of DUME (share of a domain's held-out tokens whose top-1
expert is its own), the effect of the number of statistics tokens per row (the first 2, 16 or
all), and adding the third domain to a model merged from the first two (the old domains'
scores before and after, keeping the first merge's shared weights and old statistics, and
re-averaging the shared weights over all three with fresh statistics). MoE methods use top_k 2
unless named k 1 (DUME+ and BTX need k >= 2: at k 1 the renormalised gate is 1 and the router
gets no gradient). BTX and DUME+ get the same budget (as in the authors' code, which trains
both 1000 steps at lr 1e-4); here ``--router_steps`` at lr 1e-3, not the authors' 1000 steps,
for the CPU's time (1000 router steps per method and seed would triple the run).

The paper column is DUME Table 2's average: ordering only (a 115M model, five M2D2 domains and
experts trained far longer; here a 1M-parameter byte model on three offline domains).

    python -m benchmarks.dume                  # 3 seeds, the default budget
    python -m benchmarks.dume --micro          # a quick end-to-end check
    python -m benchmarks.dume --report runs/bench_dume/dume.json

Budget flags (defaults; --micro's in brackets): --seeds 3 [1], --seed_steps 200 [10],
--expert_steps 150 [10], --router_steps 80 [5], --batch 16 [4], --seq_len 128 [32],
--eval_batches 6 [1], --stats_batches 8 [1], --d_model 128, --layers 4, --out runs/bench_dume.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from benchmarks.common import (add_budget_flags, fill_budget_defaults, paired_by_seed,
                               report_or_run)

DEFAULTS = dict(seeds=3, seed_steps=200, expert_steps=150, router_steps=80, batch=16,
                seq_len=128, eval_batches=6, stats_batches=8, d_model=128, layers=4,
                out="runs/bench_dume")
MICRO = dict(seeds=1, seed_steps=10, expert_steps=10, router_steps=5, batch=4, seq_len=32,
             eval_batches=1, stats_batches=1, out="runs/bench_dume_micro")
# DUME paper, Table 2 (115M Llama, five M2D2 domains): average normalised score.
PAPER_AVERAGE = {"expert": "72.7-81.2", "averaging": "83.4", "random": "82.4", "btx": "91.9",
                 "dume_k1": "92.8", "dume_plus": "93.9", "oracle": "94.8"}
TOKENS_PER_SEQUENCE = (2, 16, None)
# Paired by seed: (method, baseline) whose domain-mean cross-entropy difference is printed.
PAIRS = (("dume_k1", "btx"), ("dume_k1", "averaging"), ("dume_k1", "random"),
         ("dume_k2", "averaging"), ("oracle", "dume_k1"), ("dume_plus", "btx"),
         ("dume_plus", "dume_k2"), ("dume_k1_gates", "dume_k1"),
         ("dag_upcycled_finetuned", "dume_k2_finetuned"))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro", action="store_true")
    p.add_argument("--report", default="")
    p.add_argument("--json", default="")
    add_budget_flags(p, DEFAULTS)
    args = p.parse_args(argv)
    fill_budget_defaults(args, DEFAULTS, MICRO)
    return args


class Bench:
    """Models, data and jitted steps shared by every seed (one compilation each)."""

    def __init__(self, args, domains, log):
        from dagmoe_jax.config import ModelConfig
        from dagmoe_jax.families.dense.config import DenseConfig
        from dagmoe_jax.data import DataConfig, make_tokenizer

        self.args, self.domains, self.log = args, domains, log
        d = args.d_model
        self.cfg = ModelConfig(vocab_size=256, d_model=d, num_layers=args.layers,
                               num_heads=4, num_kv_heads=2,
                               block=DenseConfig(ffn_hidden=3 * d),
                               max_seq_len=max(args.seq_len, 64),
                               rope_theta=10000.0)
        self.base = DataConfig(source=domains[0][1], seq_len=args.seq_len,
                               batch_size=args.batch, tokenizer="byte")
        self.tok = make_tokenizer(self.base)
        self.steps, self.txs = {}, {}
        self.heldout = [self.batches(dataclasses.replace(self.base, source=train,
                                                          eval_source=held), eval=True)
                        for _, train, held in domains]

    def data(self, sources, seed):
        from dagmoe_jax.upcycle.command import mixed_data
        return dataclasses.replace(mixed_data(self.base, sources), seed=seed)

    def batches(self, data_cfg, eval=False, n=None):
        import itertools
        from dagmoe_jax.data.pipeline import eval_batches, train_dataset
        if eval:
            return list(eval_batches(data_cfg, self.tok, max_batches=self.args.eval_batches))
        return list(itertools.islice(iter(train_dataset(data_cfg, self.tok)), n))

    def train(self, model, data_cfg, steps, lr, trainable="all"):
        """``steps`` AdamW steps (cosine, 10 warm-up steps) of the ``trainable`` parameters."""
        import jax.numpy as jnp
        from flax import nnx
        from dagmoe_jax.run.config import OptimConfig
        from dagmoe_jax.run.optim import make_optimizer
        from dagmoe_jax.run.optim import TRAINABLE
        from dagmoe_jax.train.step import make_train_step
        from dagmoe_jax.data.pipeline import train_dataset

        key = (steps, lr)
        if key not in self.txs:
            self.txs[key] = make_optimizer(OptimConfig(
                learning_rate=lr, schedule="cosine", warmup_steps=min(10, steps - 1),
                weight_decay=0.0), steps)
        if trainable not in self.steps:
            self.steps[trainable] = make_train_step(wrt=TRAINABLE[trainable])
        opt = nnx.Optimizer(model, self.txs[key], wrt=TRAINABLE[trainable])
        it = iter(train_dataset(data_cfg, self.tok))
        for _ in range(steps):
            b = next(it)
            self.steps[trainable](model, opt, {k: jnp.asarray(b[k])
                                               for k in ("inputs", "targets", "mask")})
        return model

    def ce(self, model, domain, oracle=None):
        """Token-mean held-out cross-entropy of ``model`` on ``domain`` (``oracle``: route
        every layer to that expert)."""
        import jax.numpy as jnp
        import optax
        from dagmoe_jax.evaluation import evaluate
        from dagmoe_jax.upcycle.dume import forced_forward

        if oracle is None:
            return evaluate(model, self.heldout[domain])["loss"]
        total, count = 0.0, 0.0
        for b in self.heldout[domain]:
            batch = {k: jnp.asarray(b[k]) for k in ("inputs", "targets", "mask")}
            logits, _ = forced_forward(model, batch["inputs"], jnp.int32(oracle))
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            total += float(jnp.sum(losses * batch["mask"]))
            count += float(jnp.sum(batch["mask"]))
        return total / count

    def ces(self, model, oracle=False):
        return [self.ce(model, d, d if oracle else None) for d in range(len(self.domains))]


def statistics(bench, moe, domain_ids, tps_values):
    """Per-domain statistics (domain d forced to expert d) for several tokens-per-row limits
    from one forced pass: {limit: [DomainStatistics per domain in ``domain_ids``]}."""
    import jax.numpy as jnp
    from dagmoe_jax.upcycle.dume import forced_forward, token_mask
    from dagmoe_jax.upcycle.ridge import DomainStatistics

    cfg = moe.cfg
    out = {t: [] for t in tps_values}
    for d in domain_ids:
        stats = {t: DomainStatistics.zeros(cfg.num_layers, cfg.d_model) for t in tps_values}
        data = dataclasses.replace(bench.base, source=bench.domains[d][1], seed=99)
        for b in bench.batches(data, n=bench.args.stats_batches):
            _, x = forced_forward(moe, jnp.asarray(b["inputs"]), jnp.int32(d), head=False)
            x = np.asarray(x, np.float64).reshape(cfg.num_layers, -1, cfg.d_model)
            for t in tps_values:
                stats[t].update(x, token_mask(b, t).reshape(-1))
        for t in tps_values:
            out[t].append(stats[t])
    return out


def run_seed(bench, seed):
    from flax import nnx
    from dagmoe_jax.model import Transformer
    from dagmoe_jax.model.settle import settle
    from dagmoe_jax.upcycle import dume, moerge

    def merge(models, cfg):
        """``models`` merged into the MoE ``cfg``, run as this machine settles it."""
        return moerge.moerge(models, cfg, execution=settle(cfg), seed=seed)

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
    ce["averaging"] = bench.ces(moerge.average_models(experts))
    moe_cfg = {k: moerge.dume_config(bench.cfg, n, top_k=k) for k in (1, 2)}
    oracle = merge(experts, moe_cfg[2])
    ce["oracle"] = bench.ces(oracle, oracle=True)
    ce["random"] = bench.ces(merge(experts, moe_cfg[1]))
    random_moe = merge(experts, moe_cfg[2])
    ce["random_k2"] = bench.ces(random_moe)
    mixed = bench.data(sources, seed + 1000)
    ce["btx"] = bench.ces(bench.train(random_moe, mixed, a.router_steps, 1e-3, "router"))
    stats = statistics(bench, oracle, range(n), TOKENS_PER_SEQUENCE)
    dume_models = {}
    for k in (1, 2):
        m = merge(experts, moe_cfg[k])
        dume_models[k] = dume.dume(m, stats[None])
        ce[f"dume_k{k}"] = bench.ces(dume_models[k])
    accuracy = np.stack([dume.routing_accuracy(dume_models[2], bench.heldout[d], d)
                         for d in range(n)])                                   # [domains, L]
    tokens = {}
    for t in TOKENS_PER_SEQUENCE[:-1]:
        m = dume.dume(merge(experts, moe_cfg[2]), stats[t])
        tokens[str(t)] = bench.ces(m)
    tokens["all"] = ce["dume_k2"]
    dag = dume.upcycle_to_dag(nnx.clone(dume_models[2]), dag_dim=32, dag_iters=2, seed=seed)
    ce["dume_plus"] = bench.ces(bench.train(nnx.clone(dume_models[2]), mixed, a.router_steps,
                                            1e-3, "router"))
    ce["dume_k1_gates"] = bench.ces(bench.train(nnx.clone(dume_models[1]), mixed,
                                                a.router_steps, 1e-3, "router_and_gates"))
    ce["dume_k2_finetuned"] = bench.ces(bench.train(nnx.clone(dume_models[2]), mixed,
                                                    a.router_steps, 3e-4, "all"))
    ce["dag_upcycled_finetuned"] = bench.ces(bench.train(dag, mixed, a.router_steps, 3e-4,
                                                         "all"))
    # adding the last domain to a model merged from the others: the old domains' statistics
    # (through the smaller merge, whose averaged weights the grown model keeps) are reused
    first = merge(experts[:-1], moerge.dume_config(bench.cfg, n - 1, top_k=2))
    old = statistics(bench, first, range(n - 1), (None,))[None]
    first = dume.dume(first, old)
    before = [bench.ce(first, d) for d in range(n - 1)]
    grown = dume.add_expert(first, experts[-1], seed=seed)
    grown = dume.dume(grown, old + statistics(bench, grown, [n - 1], (None,))[None])
    after = bench.ces(grown)
    regrown = dume.add_expert(first, experts[-1], seed=seed, reaverage=True)
    regrown = dume.dume(regrown, statistics(bench, regrown, range(n), (None,))[None])
    log(f"seed {seed}: done ({time.perf_counter() - t0:.0f} s)")
    return {"ce": ce, "routing_accuracy": accuracy.tolist(), "tokens": tokens,
            "add_domain": {"before": before, "after": after,
                           "after_reaveraged": bench.ces(regrown)}}


def summarise(per_seed, domains):
    names = [d[0] for d in domains]
    n = len(names)
    own = np.array([[s["ce"][f"expert_{d}"][d] for d in range(n)] for s in per_seed])  # [S, D]

    def score(ces):                      # [S, D] -> 100 * PPL_expert / PPL_method
        return 100.0 * np.exp(own - np.asarray(ces))

    methods = list(per_seed[0]["ce"])
    rows = {}
    for m in methods:
        sc = score([s["ce"][m] for s in per_seed])
        rows[m] = {"per_domain": sc.mean(0).tolist(), "per_domain_std": sc.std(0).tolist(),
                   "average": float(sc.mean(1).mean()), "average_std": float(sc.mean(1).std())}
    best_own = all(int(np.argmin([s["ce"][f"expert_{e}"][d] for e in range(n)])) == d
                   for s in per_seed for d in range(n))
    tokens = {t: float(score([s["tokens"][t] for s in per_seed]).mean())
              for t in per_seed[0]["tokens"]}
    tokens_std = {t: float(score([s["tokens"][t] for s in per_seed]).mean(1).std())
                  for t in per_seed[0]["tokens"]}
    acc = np.array([s["routing_accuracy"] for s in per_seed])                 # [S, D, L]
    before = 100.0 * np.exp(own[:, :-1] - np.array([s["add_domain"]["before"]
                                                     for s in per_seed]))
    after = score([s["add_domain"]["after"] for s in per_seed])
    reavg = score([s["add_domain"]["after_reaveraged"] for s in per_seed])
    return {"domains": names, "methods": rows, "experts_best_on_own_domain": best_own,
            "tokens_per_sequence": tokens, "tokens_per_sequence_std": tokens_std,
            "routing_accuracy_mean": acc.mean(0).tolist(),
            "routing_accuracy_std": acc.std(0).tolist(),
            "add_domain": {"before": before.mean(0).tolist(),
                           "after": after.mean(0).tolist(),
                           "after_std": after.std(0).tolist(),
                           "after_reaveraged": reavg.mean(0).tolist(),
                           "after_reaveraged_std": reavg.std(0).tolist()}}


def format_report(results):
    s = results["summary"]
    names = s["domains"]
    lines = [f"DUME benchmark: {results['seeds']} seeds; score = 100 * PPL_expert(d) / "
             f"PPL_method(d) (mean ± std over seeds); paper: DUME Table 2 average, ordering "
             f"only (115M model, five M2D2 domains, longer-trained experts)",
             f"{'method':<24}" + "".join(f"{n:>16}" for n in names)
             + f"{'average':>16}{'paper (ordering only)':>23}"]
    for m, r in s["methods"].items():
        paper = PAPER_AVERAGE.get("expert" if m.startswith("expert_") else m, "")
        cells = "".join(f"{v:>9.1f} ± {e:<4.1f}" for v, e in zip(r["per_domain"],
                                                                 r["per_domain_std"]))
        lines.append(f"{m:<24}{cells}{r['average']:>9.1f} ± {r['average_std']:<4.1f}"
                     f"{paper:>23}")
    lines.append(f"each expert best on its own domain in every seed: "
                 f"{s['experts_best_on_own_domain']}")
    lines.append("DUME k 2 routing accuracy (top-1 = own domain), per layer, mean over seeds:")
    for n, row in zip(names, s["routing_accuracy_mean"]):
        lines.append(f"  {n:<22}" + " ".join(f"{100 * v:6.1f}%" for v in row))
    lines.append("DUME k 2 average score by statistics tokens per row: " + ", ".join(
        f"{t}: {v:.1f} ± {s['tokens_per_sequence_std'][t]:.1f}"
        for t, v in s["tokens_per_sequence"].items()))
    lines.append("paired by seed: domain-mean held-out cross-entropy, method - baseline "
                 "(nats/byte; negative = method better), mean ± std over seeds:")
    lines += paired_by_seed(results["per_seed"], PAIRS)
    ad = s["add_domain"]
    lines.append(f"adding {names[-1]} to the merge of the others (k 2), keeping the shared "
                 f"weights and old statistics: old domains' scores "
                 + ", ".join(f"{n} {b:.1f} -> {a:.1f}"
                             for n, b, a in zip(names[:-1], ad["before"], ad["after"]))
                 + f"; new domain {ad['after'][-1]:.1f}; average {np.mean(ad['after']):.1f}")
    if "after_reaveraged" in ad:
        re = ad["after_reaveraged"]
        lines.append("  re-averaged shared weights, fresh statistics for every domain: "
                     + ", ".join(f"{n} {v:.1f}" for n, v in zip(names, re))
                     + f"; average {np.mean(re):.1f}")
    return "\n".join(lines)


def run(args, out, log):
    from benchmarks.experiments.corpus import (build_c_header_corpus, build_manpage_corpus,
                                               build_stdlib_corpus, corpus_sources)
    domains = []
    for name, build in (("stdlib_docs", build_stdlib_corpus), ("manpages", build_manpage_corpus),
                        ("c_headers", build_c_header_corpus)):
        info = build(out / "corpus")
        train, held = corpus_sources(info)
        domains.append((name, train, held))
        log(f"domain {name}: {info.train_bytes:,} bytes for training, "
            f"{info.heldout_bytes:,} held out")
    bench = Bench(args, domains, log)
    per_seed = [run_seed(bench, seed) for seed in range(args.seeds)]
    return {"seeds": args.seeds, "budget": {k: getattr(args, k) for k in DEFAULTS},
            "per_seed": per_seed, "summary": summarise(per_seed, domains)}


def main(argv=None) -> int:
    return report_or_run(parse_args(sys.argv[1:] if argv is None else argv), "dume.json", run,
                         format_report)


if __name__ == "__main__":
    sys.exit(main())
