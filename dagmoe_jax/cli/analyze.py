"""Write the analysis plots of a trained run.

    dagmoe-analyze --run_dir=runs/default --out=runs/default/plots
    dagmoe-analyze --run_dir=DIR --out=DIR --data="text:notes/*.txt" --batches 8
    python -m dagmoe_jax.cli.analyze ...       (the same command)

Flags:
  --run_dir=DIR   a run directory written by train.py (config.json, checkpoints, metrics.jsonl),
                  or hf:FOLDER, a Hugging Face folder (no training curves)
  --out=DIR       where the PNGs go (created; files of other names there are kept): staged
                  and moved in when complete, so a stopped analysis leaves none
  --data=SPEC     a DataConfig source spec to trace (default: the run's own held-out data)
  --batches=N     batches of the run's batch_size x seq_len to trace (default 4)

Writes, where they apply: expert_load.png (layers x experts), coactivation.png (CoE runs:
expert pairs across iterations, as CoE Figure 8), edge_gates.png and edge_gate_hist.png
(DAG-MoE runs: mean and spread over tokens of each node pair's gate, per layer and iteration),
dropped_fraction.png (capacity drops), load_balance.png (each layer's max / mean expert load
over training and the last record's load per expert) and training_curves.png (loss and
learning rate), these three from metrics.jsonl, and summary.json: for DAG-MoE the edge-gate
sparsity per layer and iteration (share of |e_(i,j)| < 0.1, and of node pairs whose mean |e|
is below it), also printed. One line per file: the file written, or why not.
Exit status: 0 done, 2 invalid arguments, run directory or data (a one-line message).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from dagmoe_jax.command_line import OneLineParser, quiet_background_errors, report_error
from dagmoe_jax.stopping import (output_complete, remove_on_stop, run_command,
                                 set_stop_message)


def main(argv=None) -> int:
    parser = OneLineParser(add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--run_dir", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--data", default="")
    parser.add_argument("--batches", type=int, default=4)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if args.help:
            print(__doc__)
            return 0
        if not args.run_dir or not args.out:
            raise ValueError("--run_dir=DIR and --out=DIR are required (see --help)")
        if args.batches < 1:
            raise ValueError(f"--batches={args.batches} is invalid: expected an integer >= 1")
        quiet_background_errors()
        # pylint: disable=import-outside-toplevel
        from dagmoe_jax.analysis.report import analyze_run, summary_lines
        from dagmoe_jax.hf.run import open_run
        from dagmoe_jax.run.paths import partial_path, staged_directory

        set_stop_message(f"the analysis stopped; nothing new was left in {args.out}")
        remove_on_stop(args.out)
        remove_on_stop(partial_path(args.out, merge=True))
        run = open_run(args.run_dir)
        with staged_directory(args.out, merge=True) as stage:   # moved there when complete
            results = analyze_run(run, args.run_dir, stage, data=args.data,
                                  max_batches=args.batches)
        output_complete()
        out = Path(args.out).expanduser()
        results = [r if r.path is None else
                   dataclasses.replace(r, path=out / r.path.relative_to(stage)) for r in results]
    except (ValueError, FileNotFoundError) as err:
        return report_error(err)
    for result in results:
        if result.path is not None:
            print(f"wrote {result.path}")
            if result.name == "summary":
                for line in summary_lines(json.loads(result.path.read_text())):
                    print(line)
        else:
            print(f"skipped {result.name}: {result.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
