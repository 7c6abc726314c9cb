"""Pre-training with and without document boundaries in the packed rows (DataConfig.segment_packing).

    python -m benchmarks.segment_packing                 # MoE, 3 seeds, the quality budget
    python -m benchmarks.segment_packing --micro         # a quick end-to-end check

Trains MoE on the offline corpus (the standard library's docstrings, as benchmarks/quality.py,
at its budget) twice per seed: rows packed end to end as today (attention crosses documents,
and the EOS predicts the next document's first token), and with ``segment_packing`` (segment
ids: attention stays in a document, positions restart, no prediction across a boundary). Each
model is scored on both views of the held-out text: end to end (every next-token prediction of
the packed rows) and per document (within-document predictions, positions from each document's
start). Prints held-out loss (nats/token) per cell with the seed spread, the seed-paired
differences, and each run's training time. The default, ``segment_packing=False``, follows from
this table (benchmarks/RESULTS.md).

Flags: --seeds 3 [1], --steps 400 [10], --batch 16 [4], --seq_len 128 [64], --eval_batches 32
[2], --out runs/bench_segments [runs/bench_segments_micro] (--micro's in brackets).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from benchmarks.common import add_budget_flags, fill_budget_defaults, run_and_report

DEFAULTS = dict(seeds=3, steps=400, batch=16, seq_len=128, eval_batches=32,
                out="runs/bench_segments")
MICRO = dict(seeds=1, steps=10, batch=4, seq_len=64, eval_batches=2,
             out="runs/bench_segments_micro")
VIEWS = {"end to end": False, "per document": True}


def run(args, out: Path) -> dict:
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax.evaluation import evaluate_checkpoint
    from benchmarks.experiments.corpus import build_stdlib_corpus, corpus_sources
    from benchmarks.experiments.quality import QualityBudget, run_configs
    from dagmoe_jax.train.loop import train

    source, eval_source = corpus_sources(build_stdlib_corpus(out / "corpus"))
    budget = QualityBudget(source=source, eval_source=eval_source, variants=("moe",),
                           seeds=tuple(range(args.seeds)), steps=args.steps,
                           batch_size=args.batch, seq_len=args.seq_len,
                           eval_batches=args.eval_batches)
    records = []
    for seed in budget.seeds:
        for trained, packing in VIEWS.items():
            run_dir = out / "runs" / ("segments" if packing else "plain") / f"seed{seed}"
            model_cfg, data_cfg, optim_cfg, run_cfg = run_configs(budget, "moe", seed, run_dir)
            data_cfg = dataclasses.replace(data_cfg, segment_packing=packing)
            start = time.perf_counter()
            result = train(model_cfg, data_cfg, optim_cfg, run_cfg, progress=False,
                           log=lambda _m: None)
            if result.interrupted:
                raise KeyboardInterrupt(f"interrupted: {run_dir} saved; run again to resume")
            seconds = time.perf_counter() - start
            record = {"seed": seed, "trained": trained, "seconds": round(seconds, 1)}
            for view, segments in VIEWS.items():
                record[view] = evaluate_checkpoint(
                    run_dir, eval_batches_limit=args.eval_batches,
                    data_overrides={"segment_packing": segments}, log=lambda _m: None)["loss"]
            print(f"seed {seed} trained {trained:<12} held-out loss: end to end "
                  f"{record['end to end']:.4f}, per document {record['per document']:.4f} "
                  f"({seconds:.0f} s)", flush=True)
            records.append(record)
    return {"budget": dataclasses.asdict(budget), "records": records}


def format_report(results: dict) -> str:
    from benchmarks.experiments.scoring import mean_std, paired_difference

    records = results["records"]
    budget = results["budget"]
    lines = [f"MoE pre-trained with rows packed end to end vs with segment ids "
             f"({len({r['seed'] for r in records})} seeds, {budget['steps']} steps x "
             f"{budget['batch_size']} x {budget['seq_len']} tokens); held-out loss "
             f"(nats/token, mean ± std over seeds) on each view of the held-out text:", "",
             "| trained | end to end | per document | training time (s) |", "|---|---|---|---|"]
    for trained in VIEWS:
        rows = [r for r in records if r["trained"] == trained]
        cells = [f"{m:.4f} ± {s:.4f}" for m, s in (mean_std([r[v] for r in rows])
                                                   for v in VIEWS)]
        seconds = mean_std([r["seconds"] for r in rows])
        lines.append(f"| {trained} | " + " | ".join(cells) + f" | {seconds[0]:.0f} |")
    lines += ["", "Seed-paired difference, segments - end to end (negative: segments better; "
                  "'~' inside the seed spread, a paired t-test at 5%):"]
    for view in VIEWS:
        by = {t: {r["seed"]: r[view] for r in records if r["trained"] == t} for t in VIEWS}
        p = paired_difference(by["per document"], by["end to end"])
        lines.append(f"  on the {view} view: {p['mean']:+.4f} ± {p['std']:.4f}"
                     f"{'' if p['beyond_spread'] else ' ~'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--json", default=None)
    add_budget_flags(parser, DEFAULTS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    fill_budget_defaults(args, DEFAULTS, MICRO)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return run_and_report(out, args.json, "segments.json", lambda: run(args, out), format_report)


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()
    sys.exit(main())
