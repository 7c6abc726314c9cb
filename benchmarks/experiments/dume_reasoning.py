"""DUME's reasoning setting in miniature (its Tables 1 and 3), offline.

The paper merges Llama-3B instruct experts downloaded from Hugging Face into one MoE, with the
routers solved in closed form from statistics of instruction data in the experts' chat format,
and scores the merged model, untrained, against the experts on each one's benchmark. Here, per
seed:

1. a dense model is pre-trained on the corpus (the downstream pipeline's budget);
2. it is fine-tuned into two experts, one per skill domain of
   :mod:`experiments.instructions` (math: add, max, sort; text: reverse, count,
   upper), and each expert is **saved in Hugging Face Llama format**
   (:func:`dagmoe_jax.hf.llama.export_hf_llama`);
3. the Hugging Face folders are merged by DUME (:func:`dagmoe_jax.upcycle.command.build_dume`,
   top-1 routing, no training) with the statistics of each domain's **instruction records
   rendered in the chat format** (the plain template the experts learned), and, as the paper's
   baseline, by parameter averaging;
4. the experts, the average and the DUME model are scored through lm-evaluation-harness on both
   domains' held-out multiple-choice and generation tasks.

The report gives each model's scores (mean ± std over seeds) and how much of each domain
expert's own score DUME keeps on that domain (the paper: up to 102.1% in this setting).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List

from dagmoe_jax.data.tokenizers import ByteTokenizer
from experiments.downstream import (DownstreamBudget, finetune_configs,
                                    prepare_data, score, train_run)
from experiments.instructions import DOMAINS
from experiments.quality import run_configs
from experiments.scoring import mean_std

MODELS = ("expert math", "expert text", "average", "DUME")


def run_dume(budget: DownstreamBudget, out_dir, *, stats_batches: int = 8,
             log: Callable[[str], None] = lambda _m: None) -> dict:
    """Steps 1-4 of the module docstring for every seed; the results dict."""
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.hf import llama as hf_llama
    from dagmoe_jax.upcycle import moerge
    from dagmoe_jax.upcycle.command import (build_dume, domain_batches, domain_data,
                                            load_dense, mixed_data, write_run)

    out = Path(out_dir)
    start = time.perf_counter()
    data = prepare_data(budget, out)
    columns = {c: t for c, t in data["columns"].items() if not c.endswith("bpb")}
    records: List[dict] = []
    for seed in budget.seeds:
        t0 = time.perf_counter()
        root = out / "dume" / f"seed{seed}"
        cfg, data_cfg, optim_cfg, train_cfg = run_configs(
            budget.quality_budget("moe", seed), "moe", seed, root / "dense")
        dense_cfg = cfg.replace(block="dense")
        train_run(dense_cfg, data_cfg, optim_cfg, train_cfg)
        folders, sources = [], []
        for domain in DOMAINS:
            expert_dir = root / f"expert_{domain}"
            configs = finetune_configs(budget, "moe", seed, root / "dense", expert_dir,
                                       data["sft"][domain], model_cfg=dense_cfg)
            train_run(*configs)
            scores = score(expert_dir, data["tasks"], columns)
            records.append({"model": f"expert {domain}", "seed": seed, **scores})
            folder = root / "hf" / domain
            if not (folder / "config.json").is_file():
                hf_llama.export_hf_llama(run_lib.load_run(expert_dir).model, folder)
            folders.append(folder)
            sources.append(configs[1].source)
        base = configs[1]
        dense = [load_dense(str(f)) for f in folders]
        tokenizer = ByteTokenizer()
        averaged = moerge.average_models([d.model for d in dense])
        records.append({"model": "average", "seed": seed, **score(
            SimpleNamespace(model=averaged, model_cfg=averaged.cfg, tokenizer=tokenizer,
                            data_cfg=base, step=0), data["tasks"], columns)})
        merged_dir = root / "dume"
        if not (merged_dir / run_lib.CHECKPOINT_DIR).exists():
            moe, moe_cfg, stats = build_dume(
                dense, [lambda s=s: domain_batches(domain_data(base, s), stats_batches)
                        for s in sources], top_k=1)
            write_run(str(merged_dir), moe, moe_cfg, mixed_data(base, sources), steps=1,
                      stats=stats)
        records.append({"model": "DUME", "seed": seed,
                        **score(merged_dir, data["tasks"], columns)})
        for r in records[-4:]:
            log(f"seed {seed} {r['model']:<12}" + "  ".join(
                f"{c} {r[c]:.3f}" for c in columns))
        log(f"seed {seed}: {time.perf_counter() - t0:.0f} s")
    return {"budget": dataclasses.asdict(budget), "columns": columns, "records": records,
            "stats_batches": stats_batches, "seconds": round(time.perf_counter() - start, 1)}


def retained(records: List[dict], domain: str) -> Dict[str, float]:
    """DUME's score over the domain expert's, per domain column, mean and std over seeds (the
    paper's "% of the dense expert")."""
    out = {}
    for kind in ("MC", "gen"):
        column = f"{domain} {kind}"
        ratios = []
        for seed in sorted({r["seed"] for r in records}):
            by = {r["model"]: r[column] for r in records if r["seed"] == seed}
            if by.get(f"expert {domain}"):
                ratios.append(by["DUME"] / by[f"expert {domain}"])
        if ratios:
            out[column] = mean_std(ratios)
    return out


def format_report(results: dict) -> str:
    records, columns = results["records"], list(results["columns"])
    seeds = sorted({r["seed"] for r in records})
    lines = [f"DUME's reasoning setting in miniature ({len(seeds)} seeds): two dense experts "
             f"fine-tuned from one pre-trained model, saved in Hugging Face format and merged "
             f"with top-1 routers solved from {results['stats_batches']} batches of each "
             f"domain's chat-formatted instructions (no training after merging):", "",
             "| model | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for model in MODELS:
        rows = [r for r in records if r["model"] == model]
        if rows:
            cells = []
            for c in columns:
                mean, std = mean_std([r[c] for r in rows])
                cells.append(f"{mean:.3f} ± {std:.3f}")
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
    kept = []
    for domain in DOMAINS:
        for column, (mean, std) in retained(records, domain).items():
            kept.append(f"{column} {100 * mean:.1f}% ± {100 * std:.1f}")
    if kept:
        lines += ["", "DUME's score as a share of the domain's own expert (the paper's "
                      "'% of the dense expert'; its reasoning setting: up to 102.1%): "
                      + ", ".join(kept)]
    return "\n".join(lines)
