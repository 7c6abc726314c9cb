"""Quality benchmark: held-out perplexity of each variant at equal parameters and training tokens.

Trains MoE, MoE + shared expert, DAG-MoE L 1/2/3, MLP mixing (at the budget and at the
ablation's own size) and CoE (equal added parameters; see benchmarks/experiments/variants.py) on the
same text for the same tokens, and prints held-out perplexity per variant in the paper's
framing: the improvement over MoE without a shared expert, absolute and relative, paired by
seed against MoE and against MoE + shared expert (whether each is beyond the seed spread), with
the paper's DAG-MoE-s numbers beside ours (the DAG-MoE summary's ablation table). Writes
OUT/quality.json; --report re-prints one, --compare pairs a second run's variants with it.

    python -m benchmarks.quality --seeds 3                        # offline default corpus, CPU
    python -m benchmarks.quality --seeds 3 --corpus manpages      # the installed manual pages
    python -m benchmarks.quality --micro                          # a quick end-to-end check
    python -m benchmarks.quality --seeds 3 --variants moe,moe_shared,dag_l2,coe \
        --tokens 0.1M,0.4M,1.6M                                   # a tokens ladder: the gaps' trend
    python -m benchmarks.quality --report runs/bench_quality/quality.json [--compare OTHER.json]
    python -m benchmarks.quality --data "text:/data/books/*.txt" --steps 2000
    python -m benchmarks.quality --data "jsonl:/data/pile/*.jsonl" --gin.DataConfig.tokenizer="'hf'" \
        --gin.DataConfig.tokenizer_path="'/models/llama3/tokenizer.json'" --gin.ModelConfig.vocab_size=128256
    python -m benchmarks.quality --data tfds:my_corpus --eval_data tfds:my_corpus \
        --gin.DataConfig.eval_split="'validation'" --gin.DataConfig.tfds_data_dir="'/data/tfds'"

Data: --data is any DataConfig source spec (text:<globs>, jsonl:<globs>, array_record:<globs>,
tfds:<name>); --eval_data the held-out spec (default: DataConfig.heldout_fraction of --data's
records). Without --data, --corpus picks an offline corpus (benchmarks/experiments/corpus.py, nothing
downloaded): 'stdlib' (default), the docstrings of this Python's standard library (about 1.4 MB
of English programming documentation, read with `ast`), or 'manpages', the installed English
manual pages (sections 1, 5, 7, 8; tens of MB on a Debian machine), each split by file into
training and held-out text: perplexities are comparable between variants here, not with the
paper's Pile numbers.

Budget flags (defaults; --micro's in brackets): --variants (all 8), --seeds 1 (a count, or a
list 0,3), --steps 400 [10], --batch 16 [4], --seq_len 128 [64], --eval_batches 32 [2],
--dag_dim 32, --out runs/bench_quality [runs/bench_quality_micro], --json OUT/quality.json,
--gin.CLASS.FIELD=VALUE (extra gin bindings, repeatable).

--tokens N1,N2,...: a tokens ladder instead of one budget: the grid at each training-token count
(400K, 0.4M, 1.6M; steps = N / (batch x seq_len)), smallest rung first, each in OUT/tokens_<N>
(finished runs are reused, so an interrupted ladder resumes), and a table of how each variant's
seed-paired gap to MoE moves with tokens. Writes OUT/ladder.json; --report re-prints one.

Runtime on this project's 2-core CPU, measured while another benchmark shared it: 44 minutes
for `--seeds 3` at the default budget (a run: MoE 58-86 s ... DAG-MoE L 3 163-210 s; each run's
time is in OUT/quality.json); --micro about 1 minute 40 s. The latest results (3 seeds, both
corpora, the residual readings) are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import add_budget_flags, fill_budget_defaults, run_and_report, seed_list
from dagmoe_jax.command_line import gin_flag_bindings, report_error

DEFAULTS = dict(variants="moe,moe_shared,dag_l1,dag_l2,dag_l3,mlp,mlp_small,coe", seeds="1", steps=400,
                batch=16, seq_len=128, eval_batches=32, dag_dim=32, out="runs/bench_quality")
MICRO = dict(steps=10, batch=4, seq_len=64, eval_batches=2, out="runs/bench_quality_micro")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", action="store_true", help="a quick end-to-end budget")
    parser.add_argument("--data", default="",
                        help="DataConfig source spec (default: the --corpus)")
    parser.add_argument("--corpus", default="stdlib", choices=("stdlib", "manpages"),
                        help="the offline corpus used without --data: the standard library's "
                             "docstrings, or the installed English manual pages")
    parser.add_argument("--eval_data", default="", help="held-out source spec")
    add_budget_flags(parser, DEFAULTS)
    parser.add_argument("--tokens", default="",
                        help="a tokens ladder, e.g. 0.1M,0.4M,1.6M (overrides --steps)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", default=None, metavar="QUALITY_JSON",
                        help="print the table of an earlier run's quality.json (trains nothing)")
    parser.add_argument("--compare", default=None, metavar="QUALITY_JSON",
                        help="with --report: compare this run's variants with the report's, "
                             "paired by seed (e.g. two residual readings)")
    args, rest = parser.parse_known_args(argv)
    args.bindings, unknown = gin_flag_bindings(rest)
    if unknown:
        parser.error(f"unknown argument {unknown[0]!r}")
    fill_budget_defaults(args, DEFAULTS, MICRO)
    return args


def reprint(path: str, compare: str = "") -> int:
    """The table of a written quality.json, its summary recomputed from the runs; with
    ``compare``, a second run's variants against it, paired by seed."""
    from benchmarks.experiments.quality import compare_runs, format_ladder, format_report, summarize
    loaded = {}
    for name in filter(None, (path, compare)):
        try:
            loaded[name] = json.loads(Path(name).read_text())
            for rung in loaded[name].get("ladder", [loaded[name]]):
                rung["summary"] = summarize(rung["runs"])
        except (OSError, ValueError, KeyError) as err:
            return report_error(ValueError(f"cannot read {name}: {err}"))
    if "ladder" in loaded[path]:
        print(format_ladder(loaded[path]))
        return 0
    print(format_report(loaded[path]))
    if compare:
        print(f"\nA = {path}, B = {compare}\n")
        print(compare_runs(loaded[path]["runs"], loaded[compare]["runs"]))
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        return reprint(args.report, args.compare or "")
    # Imported after argument parsing so that --help and argument errors are instant.
    from benchmarks.experiments.corpus import (build_manpage_corpus, build_stdlib_corpus,
                                               corpus_sources)
    from benchmarks.experiments.quality import (QualityBudget, format_ladder, format_report,
                                                ladder_budgets, parse_tokens, run_benchmark,
                                                run_ladder)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = None
    source, eval_source = args.data, args.eval_data
    if not source:
        try:
            corpus = (build_stdlib_corpus(out / "corpus") if args.corpus == "stdlib"
                      else build_manpage_corpus(out / "corpus"))
        except FileNotFoundError as err:
            return report_error(err)
        source, default_eval = corpus_sources(corpus)
        eval_source = eval_source or default_eval
        what = (f"docstrings of the Python {corpus.python} standard library ({corpus.files} "
                f"files, {corpus.docstrings:,} docstrings)" if args.corpus == "stdlib" else
                f"English manual pages, sections 1, 5, 7, 8 ({corpus.files:,} pages)")
        print(f"corpus: {what}: {corpus.train_bytes:,} bytes for training, "
              f"{corpus.heldout_bytes:,} held out ({corpus.heldout_files} files)", flush=True)
    try:
        budget = QualityBudget(source=source, eval_source=eval_source,
                               variants=tuple(v for v in args.variants.split(",") if v),
                               seeds=seed_list(args.seeds), steps=args.steps,
                               batch_size=args.batch, seq_len=args.seq_len,
                               eval_batches=args.eval_batches, dag_dim=args.dag_dim,
                               bindings=tuple(args.bindings))
        ladder = ladder_budgets(budget, [parse_tokens(t) for t in args.tokens.split(",") if t])
        if ladder and "moe" not in budget.variants:
            raise ValueError("--tokens reports each variant's gap to MoE: add moe to --variants")
    except (ValueError, IndexError) as err:
        return report_error(err)
    if ladder:
        print(f"quality ladder: {len(budget.variants)} variants x seeds {budget.seeds} at "
              + ", ".join(f"{b.tokens_per_run:,}" for b in ladder) + f" training tokens "
              f"(batch {budget.batch_size} x {budget.seq_len}); runs in {out}/tokens_*", flush=True)
        return run_and_report(out, args.json, "ladder.json",
                              lambda: run_ladder(ladder, out, log=lambda line: print(line, flush=True)),
                              format_ladder, extra={"corpus": None if corpus is None else corpus.__dict__})
    print(f"quality benchmark: {len(budget.variants)} variants x seeds {budget.seeds}, "
          f"{budget.steps} steps of {budget.batch_size} x {budget.seq_len} tokens each; runs in "
          f"{out / 'runs'}", flush=True)
    return run_and_report(out, args.json, "quality.json",
                          lambda: run_benchmark(budget, out, log=lambda line: print(line, flush=True)),
                          format_report, extra={"corpus": None if corpus is None else corpus.__dict__})

if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    sys.exit(main())
