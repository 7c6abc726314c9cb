"""DP reasoning suite: exact-answer accuracy by problem size, variant x size, several seeds.

Trains each variant (MoE, MoE + shared expert, DAG-MoE L 1/2/3, MLP mixing, CoE; equal added
parameters, equal training tokens) on each dynamic-programming task (longest increasing
subsequence, edit distance, longest common subsequence) with the library's training loop, then
scores exact answers on in-distribution sizes and on sizes longer than any seen in training.
Prints one table per task (mean accuracy +- std across seeds) and writes OUT/reasoning.json.

    python -m benchmarks.reasoning                      # CPU default: 3 tasks x 7 variants x 2 seeds
    python -m benchmarks.reasoning --micro              # end to end in about 1-2 minutes
    python -m benchmarks.reasoning --tasks lis --variants moe,dag_l2 --seeds 3 --steps 1000

Budget flags (defaults in brackets; --micro changes the defaults to the bracketed second value):
  --tasks LIST        lis,edit_distance,lcs                [lis]
  --variants LIST     moe,moe_shared,dag_l1,dag_l2,dag_l3,mlp,coe
  --seeds N|LIST      2 (seeds 0,1), or an explicit list    [1]
  --steps N           800 training steps of --batch x --seq_len tokens   [20]
  --batch N           16                                    [8]
  --seq_len N         64
  --sizes LIST        4,8,12,16,20 (training sizes are 4-12)  [4,8,14]
  --eval_examples N   128 problems per task and size        [16]
  --dag_dim N         32: d_g of DAG-MoE L 2, which sets every variant's added parameters
  --out DIR           runs/bench_reasoning (run dirs OUT/runs/TASK/VARIANT/seedK; reused if
                      present, so an interrupted suite resumes)   [runs/bench_reasoning_micro]
  --json PATH         OUT/reasoning.json
  --report PATH       print the tables of a written reasoning.json (trains nothing)

Runtime on this project's 2-core CPU, measured while other jobs shared it (load average 2-5):
the default took 40 minutes (42 runs of 800 steps, training + scoring: MoE 40 s a run on
average, DAG-MoE L 2 70 s, L 3 82 s); --micro 1 minute 50 s. Compiled programs are cached in
OUT/jax_cache, so runs of a variant after its first (other tasks and seeds) skip most of the
compilation.

The report ends with each variant's accuracy minus MoE's, paired by seed, in and out of
distribution, and whether that is beyond the seed spread; --report OUT/reasoning.json re-prints
the tables of a finished run. The latest results are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import add_budget_flags, fill_budget_defaults, run_and_report, seed_list
from dagmoe_jax.command_line import report_error

DEFAULTS = dict(tasks="lis,edit_distance,lcs", variants="moe,moe_shared,dag_l1,dag_l2,dag_l3,mlp,coe",
                seeds="2", steps=800, batch=16, seq_len=64, sizes="4,8,12,16,20",
                eval_examples=128, dag_dim=32, out="runs/bench_reasoning")
MICRO = dict(tasks="lis", seeds="1", steps=20, batch=8, sizes="4,8,14", eval_examples=16,
             out="runs/bench_reasoning_micro")


def int_list(text: str) -> tuple:
    return tuple(int(v) for v in text.split(",") if v.strip())


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", action="store_true", help="a 1-2 minute end-to-end budget")
    add_budget_flags(parser, DEFAULTS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", default=None, metavar="REASONING_JSON",
                        help="print the tables of an earlier run's reasoning.json (trains nothing)")
    args = parser.parse_args(argv)
    fill_budget_defaults(args, DEFAULTS, MICRO)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        from benchmarks.experiments.reasoning import format_report
        try:
            results = json.loads(Path(args.report).read_text())
            print(format_report(results))
        except (OSError, ValueError, KeyError) as err:
            return report_error(ValueError(f"cannot read {args.report}: {err}"))
        return 0
    # Imported after argument parsing so that --help and argument errors are instant.
    from benchmarks.experiments.reasoning import ReasoningBudget, format_report, run_suite

    out = Path(args.out)
    try:
        budget = ReasoningBudget(
            tasks=tuple(t for t in args.tasks.split(",") if t), seeds=seed_list(args.seeds),
            variants=tuple(v for v in args.variants.split(",") if v), steps=args.steps,
            batch_size=args.batch, seq_len=args.seq_len, sizes=int_list(args.sizes),
            eval_examples=args.eval_examples, dag_dim=args.dag_dim)
    except (ValueError, IndexError) as err:
        return report_error(err)
    out.mkdir(parents=True, exist_ok=True)
    runs = len(budget.tasks) * len(budget.variants) * len(budget.seeds)
    print(f"reasoning suite: {runs} runs ({', '.join(budget.tasks)} x {len(budget.variants)} "
          f"variants x seeds {budget.seeds}), {budget.steps} steps each; runs in {out / 'runs'}",
          flush=True)
    return run_and_report(out, args.json, "reasoning.json",
                          lambda: run_suite(budget, out, log=lambda line: print(line, flush=True)),
                          format_report)


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    sys.exit(main())
