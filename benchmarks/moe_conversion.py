"""A pre-trained MoE fine-tuned as MoE, DAG-MoE and CoE, in miniature; and auxiliary-loss-free
balancing against the balance loss.

Nobody downloads anything here, so the pre-trained checkpoint is made here: a small MoE of
OLMoE's shape (a softmax router over 8 experts, top 2 without renormalisation, q/k norms over
the whole projections, the Switch balance loss at 0.01 and no z-loss) is pre-trained with
``train.py``'s loop on the docstrings of Python's standard library and written by
``dagmoe-export`` as an OLMoE folder, which stands in for OLMoE-1B-7B. Per seed, that folder is
fine-tuned on the installed manual pages (a new domain) for the same tokens four ways, each a
run with ``RunConfig.init_from='hf:FOLDER'`` as a user would start it:

  moe          as imported (its balance loss);
  dag          converted to DAG-MoE (the gin config's DAG module, d_g ``--dag_dim``, L 2;
               W_up = 0, so it starts at the MoE's outputs);
  coe          converted to Chain-of-Experts (2 iterations; the second starts as a copy of the
               router with its update scaled by a_t = 0);
  moe_auxfree  as imported, balanced by the auxiliary-loss-free bias (DeepSeek-V3, rate
               ``--bias_rate``) instead of the balance loss (coefficient 0).

Reported: the held-out cross-entropy on the manual pages of each starting model (the
conversions equal the import to float rounding) and after fine-tuning, mean and spread over
seeds, with the seed-paired difference to ``moe`` and whether it is beyond the spread (paired
t-test at 5%); and the load imbalance (the most loaded expert's share over the mean share,
averaged over layers and the last quarter of the steps) of ``moe`` and ``moe_auxfree``. The
seeds vary the fine-tuning (data order, the DAG module's initialisation), not the pre-trained
model. At this size the orderings the papers report sit inside the seed spread: read trends.

    python -m benchmarks.moe_conversion              # 3 seeds, the default budget
    python -m benchmarks.moe_conversion --micro      # a quick end-to-end check
    python -m benchmarks.moe_conversion --report runs/bench_conversion/moe_conversion.json

Budget flags (defaults; --micro's in brackets): --seeds 3 [1], --pretrain_steps 400 [8],
--finetune_steps 150 [4], --batch 16 [4], --seq_len 128 [32], --eval_batches 8 [1],
--d_model 64, --layers 4, --experts 8, --expert_hidden 64, --dag_dim 32, --bias_rate 0.001,
--out runs/bench_conversion.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import add_budget_flags, fill_budget_defaults, report_or_run

DEFAULTS = dict(seeds=3, pretrain_steps=400, finetune_steps=150, batch=16, seq_len=128,
                eval_batches=8, d_model=64, layers=4, experts=8, expert_hidden=64, dag_dim=32,
                bias_rate=0.001, out="runs/bench_conversion")
MICRO = dict(seeds=1, pretrain_steps=8, finetune_steps=4, batch=4, seq_len=32, eval_batches=1,
             out="runs/bench_conversion_micro")
VARIANTS = ("moe", "dag", "coe", "moe_auxfree")
REFERENCE = "moe"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro", action="store_true")
    p.add_argument("--report", default="")
    p.add_argument("--json", default="")
    add_budget_flags(p, DEFAULTS)
    args = p.parse_args(argv)
    fill_budget_defaults(args, DEFAULTS, MICRO)
    return args


def source_config(args):
    """The pre-trained model's ModelConfig: OLMoE's family (dagmoe_jax.hf.export.hf_family)."""
    from dagmoe_jax.config import ExpertConfig, ModelConfig, RouterConfig
    from dagmoe_jax.families.moe.config import AggregationConfig, MoEConfig
    router = RouterConfig(score_fn="softmax", top_k=2, renormalize=False, balance_coef=0.01,
                          balance_load="tokens", balance_prob="softmax", z_loss_coef=0.0)
    experts = ExpertConfig(num_experts=args.experts, expert_hidden=args.expert_hidden,
                           num_shared=0, dispatch="dropless")
    return ModelConfig(vocab_size=256, d_model=args.d_model, num_layers=args.layers,
                       num_heads=4, num_kv_heads=2, max_seq_len=max(args.seq_len, 64),
                       rope_theta=10000.0, qk_norm="full",
                       block=MoEConfig(router=router, experts=experts,
                                       aggregation=AggregationConfig(kind="sum")))


def variant_request(args, variant: str):
    """The ModelConfig a fine-tuning run of ``variant`` binds (the rest is the source's)."""
    from dagmoe_jax.config import ModelConfig, RouterConfig
    from dagmoe_jax.families.moe.config import AggregationConfig, MoEConfig
    from dagmoe_jax.families.coe.config import CoEConfig
    return {"moe": ModelConfig(),
            "dag": ModelConfig(block=MoEConfig(aggregation=AggregationConfig(
                kind="dag", dag_dim=args.dag_dim, dag_iters=2))),
            "coe": ModelConfig(block=CoEConfig(iterations=2)),
            "moe_auxfree": ModelConfig(block=MoEConfig(router=RouterConfig(
                aux_free_bias_rate=args.bias_rate, balance_coef=0.0)))}[variant]


def run_config(args, run_dir: Path, steps: int, source: str, held: str, seed: int,
               learning_rate: float, init_from: str = ""):
    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.run.config import OptimConfig, RunConfig
    data = DataConfig(source=source, eval_source=held, seq_len=args.seq_len,
                      batch_size=args.batch, seed=seed)
    optim = OptimConfig(learning_rate=learning_rate, schedule="cosine",
                        warmup_steps=min(20, steps // 4))
    run_cfg = RunConfig(run_dir=str(run_dir), steps=steps, seed=seed, init_from=init_from,
                            eval_every=0, save_every=steps, log_every=1,
                            eval_batches=args.eval_batches, task_eval_examples=0,
                            tensorboard=False)
    return data, optim, run_cfg


def load_imbalance(run_dir: Path) -> float:
    """Mean over layers and the last quarter of the steps of max/mean expert load."""
    from dagmoe_jax.run.records import read_metrics
    values = [np.mean(r["load_imbalance"]) for r in read_metrics(run_dir)
              if "load_imbalance" in r]
    return float(np.mean(values[-max(1, len(values) // 4):])) if values else float("nan")


def start_losses(args, folder: Path, data_cfg) -> dict:
    """Held-out cross-entropy of the imported folder and of its conversions, before training."""
    from dagmoe_jax.data.pipeline import eval_batches
    from dagmoe_jax.evaluation import evaluate
    from dagmoe_jax.hf.llama import load_hf_llama
    from dagmoe_jax.data import make_tokenizer
    from dagmoe_jax.train.init_from import source_data_config, source_model_config

    init_from = f"hf:{folder}"
    data_cfg = source_data_config(init_from, data_cfg)
    batches = list(eval_batches(data_cfg, make_tokenizer(data_cfg),
                                max_batches=args.eval_batches))
    out = {}
    for variant in ("moe", "dag", "coe"):
        cfg = source_model_config(init_from, variant_request(args, variant))
        model, _ = load_hf_llama(folder, convert_to=None if variant == "moe" else cfg.block)
        out[variant] = evaluate(model, batches)["loss"]
    return out


def run(args, out: Path, log) -> dict:
    from benchmarks.experiments.corpus import (build_manpage_corpus, build_stdlib_corpus,
                                               corpus_sources)
    from dagmoe_jax.hf.export import export_run
    from dagmoe_jax.model.accounting import account
    from dagmoe_jax.train.init_from import source_model_config
    from dagmoe_jax.train.loop import train

    pre_source, pre_held = corpus_sources(build_stdlib_corpus(out / "corpus"))
    ft_source, ft_held = corpus_sources(build_manpage_corpus(out / "corpus"))
    for stale in ("pretrained", "olmoe", "finetune"):
        shutil.rmtree(out / stale, ignore_errors=True)
    quiet = lambda _line: None  # noqa: E731
    pre = train(source_config(args), *run_config(args, out / "pretrained", args.pretrain_steps,
                                                 pre_source, pre_held, 0, 3e-3),
                progress=False, log=quiet)
    log(f"pre-trained the MoE: {args.pretrain_steps} steps, held-out loss "
        f"{pre.eval['loss']:.4f} on the stdlib docstrings")
    folder = export_run(str(out / "pretrained"), str(out / "olmoe"), log=log)
    init_from = f"hf:{folder}"
    data_cfg = run_config(args, out, 1, ft_source, ft_held, 0, 1e-3)[0]
    start = start_losses(args, folder, data_cfg)
    log("starting held-out loss on the manual pages: " +
        ", ".join(f"{v} {x:.6f}" for v, x in start.items()))
    params = {v: account(source_model_config(init_from, variant_request(args, v))).total_params
              for v in VARIANTS}
    records = []
    for seed in range(args.seeds):
        for variant in VARIANTS:
            run_dir = out / "finetune" / f"{variant}_s{seed}"
            result = train(variant_request(args, variant), *run_config(
                args, run_dir, args.finetune_steps, ft_source, ft_held, seed, 1e-3,
                init_from), progress=False, log=quiet)
            records.append({"variant": variant, "seed": seed, "loss": result.eval["loss"],
                            "imbalance": load_imbalance(run_dir)})
            log(f"seed {seed} {variant}: held-out loss {result.eval['loss']:.4f}, "
                f"load imbalance {records[-1]['imbalance']:.3f}")
    return {"budget": {k: getattr(args, k) for k in DEFAULTS}, "pretrained_loss":
            pre.eval["loss"], "start": start, "params": params, "records": records}


def format_report(results: dict) -> str:
    from benchmarks.experiments.scoring import mean_std, paired_difference

    b, records = results["budget"], results["records"]
    seeds = sorted({r["seed"] for r in records})

    def by_seed(variant, key):
        return {r["seed"]: r[key] for r in records if r["variant"] == variant}

    lines = [f"A pre-trained MoE fine-tuned four ways ({len(seeds)} seeds; pre-trained "
             f"{b['pretrain_steps']} steps, fine-tuned {b['finetune_steps']} steps x "
             f"{b['batch']} x {b['seq_len']} byte tokens on the manual pages; held-out "
             f"cross-entropy, nats per byte, lower is better; '~': inside the seed spread):", "",
             "| model | parameters | start | fine-tuned (mean ± sd) | vs moe (paired) "
             "| load imbalance |", "|---|---:|---:|---:|---:|---:|"]
    for variant in VARIANTS:
        loss = by_seed(variant, "loss")
        if not loss:
            continue
        mean, std = mean_std(list(loss.values()))
        start = results["start"].get(variant, results["start"]["moe"])
        if variant == REFERENCE:
            diff = "-"
        else:
            p = paired_difference(loss, by_seed(REFERENCE, "loss"))
            diff = f"{p['mean']:+.4f} ± {p['std']:.4f}{'' if p['beyond_spread'] else ' ~'}"
        imb = mean_std(list(by_seed(variant, "imbalance").values()))
        lines.append(f"| {variant} | {results['params'][variant]:,} | {start:.4f} | "
                     f"{mean:.4f} ± {std:.4f} | {diff} | {imb[0]:.3f} ± {imb[1]:.3f} |")
    gap = max(abs(results["start"][v] - results["start"]["moe"]) for v in results["start"])
    lines += ["", f"The conversions start at the import's loss (largest gap {gap:.1e}). "
              f"moe_auxfree: no balance loss, the selection bias at rate {b['bias_rate']:g} "
              f"per step."]
    return "\n".join(lines)


def main(argv=None) -> int:
    return report_or_run(parse_args(sys.argv[1:] if argv is None else argv), "moe_conversion.json", run,
                         format_report)


if __name__ == "__main__":
    sys.exit(main())
