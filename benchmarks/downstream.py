"""The papers' pipeline in miniature: pre-train, fine-tune on instructions, score downstream.

    python -m benchmarks.downstream                   # DAG-MoE Q3 / Table 2 in miniature, 3 seeds
    python -m benchmarks.downstream --dume            # DUME's reasoning setting in miniature
    python -m benchmarks.downstream --micro           # a quick end-to-end check of both
    python -m benchmarks.downstream --report runs/bench_downstream/downstream.json

Table 2 in miniature (benchmarks/experiments/downstream.py): MoE, MoE + shared expert and
DAG-MoE L 2 at equal parameters are pre-trained on the offline corpus (the standard library's
docstrings, as benchmarks/quality.py), fine-tuned 3 epochs at a constant learning rate on an
instruction set built offline (benchmarks/experiments/instructions.py: six skills with exact
answers, Alpaca records, the plain '### Instruction:' template, the loss on the responses), and
scored before and after fine-tuning through lm-evaluation-harness on held-out problems
(multiple choice: acc; generation: exact match) and on held-out corpus text (bits per byte).
--dume (benchmarks/experiments/dume_reasoning.py, its table dume_table.py): DUME's Table 3 in
miniature. A dense model is fine-tuned into four experts (numbers, ordering, spelling,
counting: two skills each), saved in Hugging Face format and merged; rows: each expert, the
oracle (the experts' diagonal, and the merged model forced to each domain's expert), parameter
averaging, random routing k 1, DUME k 1 from the authors' prompt statistics and from the packed
chat stream, DUME k 2, DUME+, BTX and the upcycled DAG (the last three trained --router_steps
steps), with the paper's normalised average.

Budget flags (defaults; --micro's in brackets): --variants moe,moe_shared,dag_l2, --seeds 3
[1], --steps 400 [8], --batch 16 [4], --seq_len 128 [64], --dag_dim 32, --sft_records 1200
[48], --sft_epochs 3 [1], --sft_lr 1e-3, --eval_per_skill 24 [2], --rolling_docs 32 [2],
--stats_batches 8 [2], --router_steps 60 [2], --router_lr 1e-3 (the last three: --dume),
--out runs/bench_downstream [runs/bench_downstream_micro], --json OUT/downstream.json (or
dume.json), --gin.CLASS.FIELD=VALUE (extra pre-training bindings).

With the real datasets, the same pipeline is three commands (docs/training.md: "Instruction
fine-tuning" and "Downstream benchmarks"): train.py for pre-training, train.py with
configs/finetune/dagmoe_paper.gin for fine-tuning, and python -m dagmoe_jax.harness with the
paper's task names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.common import add_budget_flags, fill_budget_defaults, run_and_report, seed_list
from dagmoe_jax.command_line import gin_flag_bindings, report_error

DEFAULTS = dict(variants="moe,moe_shared,dag_l2", seeds="3", steps=400, batch=16, seq_len=128,
                dag_dim=32, sft_records=1200, sft_epochs=3, sft_lr=1e-3, eval_per_skill=24,
                rolling_docs=32, stats_batches=8, router_steps=60, router_lr=1e-3,
                out="runs/bench_downstream")
MICRO = dict(seeds="1", steps=8, batch=4, seq_len=64, sft_records=48, sft_epochs=1,
             eval_per_skill=2, rolling_docs=2, stats_batches=2, router_steps=2,
             out="runs/bench_downstream_micro")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", action="store_true", help="a quick end-to-end budget")
    parser.add_argument("--dume", action="store_true", help="DUME's reasoning setting")
    add_budget_flags(parser, DEFAULTS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", default=None, metavar="JSON",
                        help="print the table of an earlier run's JSON (trains nothing)")
    args, rest = parser.parse_known_args(argv)
    args.bindings, unknown = gin_flag_bindings(rest)
    if unknown:
        parser.error(f"unknown argument {unknown[0]!r}")
    fill_budget_defaults(args, DEFAULTS, MICRO)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Imported after argument parsing so that --help and argument errors are instant.
    from benchmarks.experiments import downstream, dume_reasoning
    from benchmarks.experiments.corpus import build_stdlib_corpus, corpus_sources

    if args.report:
        try:
            results = json.loads(Path(args.report).read_text())
        except (OSError, ValueError) as err:
            return report_error(ValueError(f"cannot read {args.report}: {err}"))
        module = dume_reasoning if "stats_batches" in results else downstream
        print(module.format_report(results))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TQDM_DISABLE", "1")      # the harness's per-task progress bars
    try:
        corpus = build_stdlib_corpus(out / "corpus")
        source, eval_source = corpus_sources(corpus)
        budget = downstream.DownstreamBudget(
            source=source, eval_source=eval_source,
            variants=tuple(v for v in args.variants.split(",") if v),
            seeds=seed_list(args.seeds), steps=args.steps, batch_size=args.batch,
            seq_len=args.seq_len, dag_dim=args.dag_dim, sft_records=args.sft_records,
            sft_epochs=args.sft_epochs, sft_learning_rate=args.sft_lr,
            eval_per_skill=args.eval_per_skill, rolling_docs=args.rolling_docs,
            bindings=tuple(args.bindings))
    except (ValueError, IndexError, FileNotFoundError) as err:
        return report_error(err)
    log = lambda line: print(line, flush=True)  # noqa: E731
    if args.dume:
        print(f"DUME reasoning setting: seeds {budget.seeds}; runs in {out / 'dume'}", flush=True)
        return run_and_report(out, args.json, "dume.json",
                              lambda: dume_reasoning.run_dume(
                                  budget, out, stats_batches=args.stats_batches,
                                  router_steps=args.router_steps, router_lr=args.router_lr,
                                  log=log),
                              dume_reasoning.format_report)
    print(f"downstream pipeline: {', '.join(budget.variants)} x seeds {budget.seeds}; runs in "
          f"{out / 'runs'}", flush=True)
    return run_and_report(out, args.json, "downstream.json",
                          lambda: downstream.run_pipeline(budget, out, log=log),
                          downstream.format_report)


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    sys.exit(main())
