"""DoE benchmark: held-out perplexity of DoE and its ablations beside dense and MoE, and the
forgetting probe, at equal total parameters on a mixed offline corpus, over several seeds.

    python -m benchmarks.doe                       # the default budget: 854 s of runs on the
                                                   # shared 2-core CPU (3 seeds), plus the corpus
    python -m benchmarks.doe --micro               # a quick end-to-end check
    python -m benchmarks.doe --variants dense,moe,doe_relu --seeds 2 --steps 400
    python -m benchmarks.doe --report runs/bench_doe/doe.json

Corpus (nothing downloaded; benchmarks/experiments/corpus.py): the docstrings of this Python's standard
library (programming documentation, many short records) mixed with the installed English manual
pages of sections 5 and 7 (file formats and overviews, one record per page), each split by file
into training and held-out text. Stage 1 (online LDA, --topics topics, on the first
--lda_documents training records in order) is fitted once and shared by every DoE run
(DataConfig.topics_dir), as the paper's one-time offline stage.

Variants (all but moe_active at the dense model's total parameters, matched by each block's FFN /
expert width with dagmoe_jax/model/accounting.py): dense; moe (softmax gate + balance loss, top-2
of 8: Table 3 A); moe_active (the same MoE at doe_relu's *active* parameters: its experts widened
until a token uses as many weights as the composed DoE, all of whose weights are active);
doe_softmax (Table 3 B); doe_relu (Table 3 C, the paper's DoE, alpha 0.001); doe_blocks
(doe_relu under the sparse reading, DoEConfig.expert='blocks': every knowledge block its own FFN
slice, Top-N = topics / 4, matched at equal total by block_hidden); doe_kl0.01 (doe_relu with
the VAE's KL term weighted 0.01 instead of 0: does keeping the noise of eq. 6 matter); doe_theta
(doe_relu with the first layer's VAE fed the causal topic distribution theta(<t)^T E_know
instead of one topic id's embedding, DoEConfig.first_input='theta'); doe_a0,
doe_a0.01, doe_a0.1 (Table 2's alpha sweep); doe_no_lda (Appendix E: no topics, no expert loss); doe_k, doe_q
(Table 10: the router's signal from the keys or the queries instead of the values).

Forgetting probe (Table 14, scaled down): each --forget variant's trained model continues
--forget_steps steps on the standard-library text alone (the "code" domain, optimiser state
fresh, constant learning rate); the held-out loss on both domains is measured before and after.
Forgetting = the increase of the manual pages' loss.

Budget flags (defaults; --micro's in brackets): --variants (all), --seeds 3 [1], --steps 150 [10],
--batch 8 [4], --seq_len 128 [64], --eval_batches 16 [2], --topics 32 [8], --lda_documents 3000
[300], --forget moe,doe_relu,doe_blocks [doe_relu], --forget_steps 100 [5], --out runs/bench_doe
[runs/bench_doe_micro]. Writes OUT/doe.json; prints the table with the paper's numbers beside.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from benchmarks.experiments.scoring import mean_std, paired_difference

VARIANTS = ("dense", "moe", "moe_active", "doe_softmax", "doe_relu", "doe_blocks", "doe_kl0.01",
            "doe_theta", "doe_a0", "doe_a0.01", "doe_a0.1", "doe_no_lda", "doe_k", "doe_q")
DEFAULTS = dict(variants=",".join(VARIANTS), seeds=3, steps=150, batch=8, seq_len=128,
                eval_batches=16, topics=32, lda_documents=3000, forget="moe,doe_relu,doe_blocks",
                forget_steps=100, out="runs/bench_doe")
MICRO = dict(seeds=1, steps=10, batch=4, seq_len=64, eval_batches=2, topics=8,
             lda_documents=300, forget="doe_relu", forget_steps=5, out="runs/bench_doe_micro")
D_MODEL, LAYERS, DENSE_HIDDEN = 64, 2, 256

# The paper's validation perplexities (DoE-5B / 7B ablations; seed 003 Tables 2, 3, 8, 10) and
# Table 14's seesaw probe. Directions are what can be compared, not values.
PAPER = {"moe": 30.89, "doe_softmax": 30.48, "doe_relu": 30.25, "doe_a0": 30.51,
         "doe_a0.01": 30.65, "doe_a0.1": 30.33, "doe_no_lda": 30.82, "doe_k": 30.55,
         "doe_q": 30.98}
PAPER_FORGET = {"moe": "History 68.2 -> 62.1 (-6.1)", "doe_relu": "History 90.1 -> 89.9 (-0.2)",
                "doe_blocks": "History 90.1 -> 89.9 (-0.2)"}


def model_config(variant: str, topics: int, seq_len: int):
    """The variant's ModelConfig, its FFN / expert width set for the dense model's total."""
    from dagmoe_jax.model.accounting import account
    from dagmoe_jax.config import ExpertConfig, ModelConfig, RouterConfig
    from dagmoe_jax.families.dense.config import DenseConfig
    from dagmoe_jax.families.doe.config import DoEConfig
    from dagmoe_jax.families.moe.config import MoEConfig

    base = ModelConfig(vocab_size=256, d_model=D_MODEL, num_layers=LAYERS, num_heads=4,
                       num_kv_heads=2, max_seq_len=max(seq_len, 64),
                       block=DenseConfig(ffn_hidden=DENSE_HIDDEN))
    target, count = account(base).total_params, lambda a: a.total_params
    widths = range(8, 4 * DENSE_HIDDEN + 1, 8)
    if variant == "dense":
        return base
    if variant == "moe_active":                  # equal active parameters with doe_relu
        target = account(model_config("doe_relu", topics, seq_len)).total_active_params
        count, widths = (lambda a: a.total_active_params), range(8, 16 * DENSE_HIDDEN + 1, 8)
    if variant in ("moe", "moe_active"):
        make = lambda h: base.replace(block=MoEConfig(
            router=RouterConfig(score_fn="softmax", top_k=2, balance_coef=0.01),
            experts=ExpertConfig(num_experts=8, expert_hidden=h, dispatch="capacity",
                                 capacity_factor=2.0)))
    else:
        doe = dict(num_topics=topics, topic_dim=16, vae_hidden=32, latent_dim=16)
        doe.update({"doe_softmax": dict(gate="softmax"), "doe_a0": dict(alpha=0.0),
                    "doe_a0.01": dict(alpha=0.01), "doe_a0.1": dict(alpha=0.1),
                    "doe_no_lda": dict(use_topics=False, alpha=0.0), "doe_k": dict(signal="k"),
                    "doe_q": dict(signal="q"), "doe_kl0.01": dict(kl_coef=0.01),
                    "doe_theta": dict(first_input="theta")}.get(variant, {}))
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}: expected one of {', '.join(VARIANTS)}")
        make = lambda h: base.replace(block=DoEConfig(**doe, ffn_hidden=h))
        if variant == "doe_blocks":
            doe.update(expert="blocks", top_n=max(1, topics // 4))
            make = lambda h: base.replace(block=DoEConfig(**doe, ffn_hidden=DENSE_HIDDEN,
                                                          block_hidden=h))
            widths = range(1, DENSE_HIDDEN + 1)
    best = min(widths, key=lambda h: abs(count(account(make(h))) - target))
    return make(best)


def corpus(out: Path, log):
    from benchmarks.experiments.corpus import build_manpage_corpus, build_stdlib_corpus

    stdlib = build_stdlib_corpus(out / "corpus")
    man = build_manpage_corpus(out / "corpus", sections=("5", "7"))
    log(f"corpus: stdlib docstrings {stdlib.train_bytes:,} + manual pages (5, 7) "
        f"{man.train_bytes:,} training bytes; {stdlib.heldout_bytes:,} + {man.heldout_bytes:,} "
        "held out")
    return stdlib, man


def data_config(args, source: str, eval_source: str, seed: int, topics_dir: str = ""):
    from dagmoe_jax.data import DataConfig

    return DataConfig(source=source, eval_source=eval_source, seq_len=args.seq_len,
                      batch_size=args.batch, seed=seed, topics_dir=topics_dir)


def fit_stage1(args, out: Path, source: str, log) -> str:
    from dagmoe_jax.families.doe.topics import TopicConfig, fit_topics
    from dagmoe_jax.families.doe.topics.stage import training_documents

    path = out / f"topics_k{args.topics}_d{args.lda_documents}"
    if not (path / "topics.npz").is_file():
        start = time.perf_counter()
        docs = training_documents(data_config(args, source, "", 0), args.lda_documents)
        model = fit_topics(docs, args.topics, TopicConfig(max_iter=5, vocab_size=5000))
        model.save(str(path))
        log(f"stage 1: online LDA, {args.topics} topics on {len(docs)} records, "
            f"{time.perf_counter() - start:.0f} s; e.g. " + "; ".join(
                " ".join(w[:4]) for w in model.top_words(4)[:3]))
    return str(path)


def doe_metrics(run_dir: str) -> dict:
    """The last logged training step's vae_log_sigma and gate_active_fraction of a DoE run
    ({} for other blocks)."""
    path = Path(run_dir) / "metrics.jsonl"
    last = {}
    for line in (path.read_text().splitlines() if path.is_file() else []):
        record = json.loads(line)
        if "vae_log_sigma" in record:
            last = {k: record[k] for k in ("vae_log_sigma", "gate_active_fraction")}
    return last


def run_one(args, variant, seed, data_cfg, out: Path):
    from dagmoe_jax.model.accounting import account
    from dagmoe_jax.run.config import RunConfig
    from dagmoe_jax.train.loop import train
    from dagmoe_jax.run.config import OptimConfig

    model_cfg = model_config(variant, args.topics, args.seq_len)
    run_dir = out / "runs" / f"{variant}_s{seed}"
    run_cfg = RunConfig(steps=args.steps, seed=seed, run_dir=str(run_dir),
                            log_every=max(1, args.steps // 4), eval_every=0,
                            eval_batches=args.eval_batches, task_eval_examples=0,
                            save_every=args.steps, tensorboard=False, async_checkpoint=False)
    optim = OptimConfig(learning_rate=3e-3, warmup_steps=max(1, min(50, args.steps // 5)))
    start = time.perf_counter()
    result = train(model_cfg, data_cfg, optim, run_cfg, progress=False, log=lambda _m: None)
    acc = account(model_cfg, args.seq_len)
    return {"variant": variant, "seed": seed, "loss": result.eval["loss"],
            "perplexity": result.eval["perplexity"], "params": acc.total_params,
            "active_params": acc.total_active_params, "run_dir": str(run_dir),
            "seconds": round(time.perf_counter() - start, 1), **doe_metrics(str(run_dir))}


def forgetting(args, record, code_cfg, evals, log) -> dict:
    """Continue ``record``'s model on the code domain; held-out losses before and after."""
    import jax
    import optax
    from flax import nnx

    from dagmoe_jax import run as run_lib
    from dagmoe_jax.data import eval_batches, make_tokenizer, train_dataset
    from dagmoe_jax.evaluation import evaluate
    from dagmoe_jax.run.extensions import extension_for
    from dagmoe_jax.train.step import make_train_step

    loaded = run_lib.load_run(record["run_dir"], data_cfg=code_cfg, log=lambda _m: None)
    model, tokenizer = loaded.model, make_tokenizer(code_cfg)
    annotate = extension_for(loaded.model_cfg).prepare_run(code_cfg, record["run_dir"],
                                                           save=False)
    held = {name: eval_batches(dataclasses.replace(code_cfg, eval_source=spec), tokenizer,
                               max_batches=args.eval_batches, annotate=annotate)
            for name, spec in evals.items()}
    before = {name: evaluate(model, b)["loss"] for name, b in held.items()}
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.1), wrt=nnx.Param)
    step = make_train_step()
    it = iter(train_dataset(code_cfg, tokenizer, annotate=annotate))
    for _ in range(args.forget_steps):
        step(model, optimizer, {k: jax.numpy.asarray(v) for k, v in next(it).items()})
    after = {name: evaluate(model, b)["loss"] for name, b in held.items()}
    log(f"  forgetting {record['variant']} seed {record['seed']}: " + ", ".join(
        f"{n} {before[n]:.4f} -> {after[n]:.4f}" for n in held))
    return {"variant": record["variant"], "seed": record["seed"], "before": before,
            "after": after}


def _paired(rs, ref) -> str:
    """Mean and sd over seeds of the per-seed perplexity ratio to ``ref`` (a seed -> ppl map),
    in percent (``scoring.paired_difference`` of the ratios against 0)."""
    ratios = {r["seed"]: 100 * (r["perplexity"] / ref[r["seed"]] - 1) for r in rs
              if r["seed"] in ref}
    if not ratios:
        return ""
    paired = paired_difference(ratios, dict.fromkeys(ratios, 0.0))
    return f"{paired['mean']:+.2f}%" + (f" sd {paired['std']:.2f}" if paired["seeds"] > 1
                                        else "")


def format_report(result: dict) -> str:
    runs_, lines = result["runs"], []
    by = {}
    for r in runs_:
        by.setdefault(r["variant"], []).append(r)
    seeds = lambda v: {r["seed"]: r["perplexity"] for r in by.get(v, [])}
    lines.append(f"{'variant':<12}{'params':>9}{'active':>9}{'ppl mean':>10}{'sd':>7}"
                 f"{'vs MoE, paired':>18}{'vs DoE-ReLU':>17}{'paper ppl':>11}{'paper vs MoE':>14}")
    for variant in [v for v in VARIANTS if v in by]:
        rs = by[variant]
        mean, sd = mean_std([r["perplexity"] for r in rs])
        vs_moe = "" if variant == "moe" else _paired(rs, seeds("moe"))
        vs_relu = "" if variant == "doe_relu" else _paired(rs, seeds("doe_relu"))
        paper = PAPER.get(variant)
        paper_rel = (f"{100 * (paper / PAPER['moe'] - 1):+.2f}%"
                     if paper and variant != "moe" else "")
        lines.append(f"{variant:<12}{rs[0]['params']:>9,}{rs[0]['active_params']:>9,}"
                     f"{mean:>10.3f}{sd:>7.3f}{vs_moe:>18}{vs_relu:>17}"
                     f"{(f'{paper:.2f}' if paper else '-'):>11}{paper_rel:>14}")
    doe_rows = [(v, [r.get("vae_log_sigma", doe_metrics(r["run_dir"]).get("vae_log_sigma"))
                     for r in by[v]],
                 [r.get("gate_active_fraction",
                        doe_metrics(r["run_dir"]).get("gate_active_fraction")) for r in by[v]])
                for v in VARIANTS if v in by and v.startswith("doe")]
    if doe_rows:
        lines.append("")
        lines.append("DoE at the last logged step (mean over seeds): VAE log sigma, share of "
                     "knowledge blocks active (non-zero gates; doe_blocks: run)")
        for v, sig, act in doe_rows:
            if None not in sig and None not in act:
                lines.append(f"  {v:<12} log sigma {mean_std(sig)[0]:+.3f}   "
                             f"active {mean_std(act)[0]:.3f}")
    if result.get("forgetting"):
        lines.append("")
        lines.append("forgetting probe: held-out loss (nats/token) before -> after continued "
                     "training on the code domain")
        fby = {}
        for f in result["forgetting"]:
            fby.setdefault(f["variant"], []).append(f)
        for variant, fs in fby.items():
            parts = []
            for name in fs[0]["before"]:
                deltas = [f["after"][name] - f["before"][name] for f in fs]
                m, s = mean_std(deltas)
                parts.append(f"{name} {m:+.4f} (sd {s:.4f})")
            lines.append(f"  {variant:<11}" + ", ".join(parts)
                         + (f"   paper: {PAPER_FORGET[variant]}" if variant in PAPER_FORGET else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--report", default=None)
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name}", type=type(value), default=None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        print(format_report(json.loads(Path(args.report).read_text())))
        return 0
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, MICRO.get(name, value) if args.micro else value)
    log = lambda line: print(line, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stdlib, man = corpus(out, log)
    source = f"text:{stdlib.train_path},{man.train_path}"
    eval_source = f"text:{stdlib.heldout_path},{man.heldout_path}"
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        model_config(v, args.topics, args.seq_len)          # unknown names fail before training
    topics_dir = fit_stage1(args, out, source, log)
    result = {"args": vars(args), "runs": [], "forgetting": []}
    start = time.perf_counter()
    for seed in range(args.seeds):
        for variant in variants:
            record = run_one(args, variant, seed,
                             data_config(args, source, eval_source, seed, topics_dir), out)
            result["runs"].append(record)
            log(f"{variant:<12}seed {seed}: held-out ppl {record['perplexity']:.3f} "
                f"({record['seconds']:.0f} s)")
            (out / "doe.json").write_text(json.dumps(result, indent=1))
    code_cfg = data_config(args, f"text:{stdlib.train_path}", eval_source, 0, topics_dir)
    evals = {"code (stdlib)": f"text:{stdlib.heldout_path}",
             "manpages": f"text:{man.heldout_path}"}
    for record in result["runs"]:
        if record["variant"] in args.forget.split(","):
            result["forgetting"].append(forgetting(args, record, code_cfg, evals, log))
            (out / "doe.json").write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.perf_counter() - start, 1)
    (out / "doe.json").write_text(json.dumps(result, indent=1))
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
