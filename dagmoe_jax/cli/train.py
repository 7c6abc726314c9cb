"""Train or evaluate a DAG-MoE (or MoE / MLP-mixing / CoE) language model.

From a checkout ``python train.py``; after ``pip install`` also ``dagmoe-train`` or
``python -m dagmoe_jax.cli.train`` (the same flags):

    python train.py                                   # the embedded default, < 10 min on a laptop CPU
    python train.py --gin_file=configs/dagmoe_s.gin --gin_file=configs/cpu_small.gin
    python train.py --gin_file=F.gin --gin.RunConfig.steps=2000 --gin.DataConfig.source="'text:data/*.txt'"
    python train.py --mode=eval --run_dir=runs/default [--eval_source=tfds:NAME --eval_split=test]

Flags:
  --gin_file=FILE       gin file (repeatable; a path, or a name under configs/, which ships
                        with the package). With no --gin_file, configs/train/default.gin.
  --gin.NAME.PARAM=VAL  a gin binding (repeatable; also --gin_bindings="NAME.PARAM = VAL").
                        Strings need gin quotes: --gin.DataConfig.tokenizer="'hf'".
  --run_dir=DIR         shorthand for --gin.RunConfig.run_dir; an existing run resumes.
  --mode=train|eval     eval: load DIR's newest checkpoint and report held-out perplexity;
                        DataConfig bindings of what is scored and how it is read apply
                        (e.g. --gin.DataConfig.text_key="'body'"; the list: EVAL_OVERRIDABLE_FIELDS
                        in dagmoe_jax/evaluation/heldout.py), any other binding is an error.
  --eval_source=SPEC    (eval) a DataConfig source spec, e.g. tfds:wikitext or text:notes/*.txt
  --eval_split=NAME     (eval, tfds) the split to score
  --eval_batches=N      (eval) batches to score (default: all)
  --no_progress         no progress bar: a plain line every RunConfig.log_every steps
                        instead (for cluster logs)
  --coordinator_address=HOST:PORT --num_processes=N --process_id=I
                        join a multi-process run (also from JAX_COORDINATOR_ADDRESS /
                        JAX_NUM_PROCESSES / JAX_PROCESS_ID; SLURM, Open MPI and TPU pod slices
                        are detected without flags). Only process 0 prints and logs.

Exit status: 0 done or interrupted and saved (SIGTERM / Ctrl-C), 1 non-finite loss,
2 invalid configuration or data (a one-line message says what to fix).
"""

from __future__ import annotations

import sys

from dagmoe_jax import stopping
from dagmoe_jax.command_line import (gin_parser, parse_gin_command, parse_or_report,
                                     quiet_background_errors, report_error)
from dagmoe_jax.train.signals import on_signals, raise_as_interrupt, stopped_before_training


def parse_args(argv):
    parser = gin_parser()
    parser.add_argument("--run_dir", default="")
    parser.add_argument("--mode", default="train", choices=("train", "eval"))
    parser.add_argument("--eval_source", default="")
    parser.add_argument("--eval_split", default="")
    parser.add_argument("--eval_batches", type=int, default=0)
    parser.add_argument("--no_progress", action="store_true")
    parser.add_argument("--coordinator_address", default="")
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    args, args.user_bindings = parse_gin_command(parser, argv, "python train.py")
    bindings = list(args.user_bindings)
    if args.run_dir:
        bindings.append(f"RunConfig.run_dir = {args.run_dir!r}")
    args.bindings = bindings
    return args


def main(argv=None) -> int:
    args, code = parse_or_report(parse_args, argv, __doc__)
    if args is None:
        return code
    stopping.set_stop_message("the evaluation stopped" if args.mode == "eval" else
                              stopped_before_training)
    # The libraries load under the stop contract of the command's entry (one line, exit 130,
    # at once: an interrupt raised inside an extension's initialisation became an ImportError
    # or an abort). Imported after argument parsing so that --help and argument errors are
    # instant.
    import gin  # pylint: disable=import-outside-toplevel,unused-import
    import jax  # pylint: disable=import-outside-toplevel,unused-import
    from dagmoe_jax.train import loop  # noqa: F401  pylint: disable=import-outside-toplevel
    from dagmoe_jax import evaluation  # noqa: F401  pylint: disable=import-outside-toplevel
    quiet_background_errors()
    # From here a signal is one line at any moment: while the run starts the contract stops
    # the command at once, from its own thread too (a compilation or a data pipeline's start
    # can hold the main thread for seconds), and removes a run directory the run created;
    # train()'s own interrupt does the same where it comes first (one a library's callback
    # swallowed is in ``signals`` for train() to stop at); once the run's config is written
    # (``started``) train() turns a signal into a checkpoint and a clean stop.
    signals: dict = {"act": stopping.stop_now}
    try:
        with on_signals(signals, interrupt=True):
            return _main(args, signals)
    except KeyboardInterrupt as err:      # a signal before the first step (Interrupted)
        name = str(err) or "SIGINT"
        stopping.stop_now(name)           # the contract's line and exit, if it still holds
        print(f"error: {name} received: the evaluation stopped" if args.mode == "eval" else
              stopped_before_training(name), file=sys.stderr)
        return 130


def _main(args, signals: dict) -> int:
    # pylint: disable=import-outside-toplevel
    import gin
    import jax
    from dagmoe_jax.config.blocks import block_summary
    from dagmoe_jax.model.accounting import account
    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.run.gin import DEFAULT_GIN, bound_fields, load_configs
    from dagmoe_jax.parallel.multihost import initialize
    from dagmoe_jax.evaluation import eval_data_overrides, evaluate_checkpoint
    from dagmoe_jax.train.init_from import source_data_config, source_model_config
    from dagmoe_jax.train.loop import NonFiniteLossError, train

    try:
        initialize(args.coordinator_address, args.num_processes, args.process_id)
        if args.mode == "eval":
            if not args.run_dir:
                raise ValueError("--mode=eval needs --run_dir=DIR (a run written by train.py)")
            if args.gin_file:
                raise ValueError("--mode=eval reads the run's own config.json: drop --gin_file "
                                 "(data bindings such as --gin.DataConfig.text_key still apply)")
            overrides = eval_data_overrides(args.user_bindings)
            evaluate_checkpoint(args.run_dir, eval_source=args.eval_source,
                                eval_split=args.eval_split, eval_batches_limit=args.eval_batches,
                                data_overrides=overrides, log=print)
            return 0
        files = args.gin_file or [DEFAULT_GIN]
        model_cfg, data_cfg, optim_cfg, run_cfg = load_configs(files, args.bindings)
        shown = model_cfg
        if run_cfg.init_from:
            shown = source_model_config(run_cfg.init_from, model_cfg)
            # A tokenizer binding that contradicts the source is refused even where it binds
            # the default's value ('byte'), which train() alone cannot tell from no binding.
            source_data_config(run_cfg.init_from, data_cfg, run_cfg.tokenizer_from_source,
                               bound=bound_fields(DataConfig))
        if jax.process_index() == 0:
            stopping.remove_on_stop(run_cfg.run_dir)   # a new one whole, else what appears
        acc = account(shown, data_cfg.seq_len)
        length = (f"{run_cfg.epochs} epochs" if run_cfg.epochs
                  else f"{run_cfg.steps} steps")
        if jax.process_index() == 0:
            print(f"config: {' + '.join(files)}{' + bindings' if args.bindings else ''}; "
                  f"{block_summary(shown.block)}; "
                  f"{acc.total_params / 1e6:.2f}M params ({acc.total_active_params / 1e6:.2f}M "
                  f"active); {length} of {data_cfg.batch_size}x{data_cfg.seq_len} "
                  f"tokens from {data_cfg.source}; {jax.device_count()} devices in "
                  f"{jax.process_count()} processes; run dir {run_cfg.run_dir}", flush=True)
        train(model_cfg, data_cfg, optim_cfg, run_cfg, progress=not args.no_progress,
              operative_gin=gin.operative_config_str(), signals=signals,
              started=stopping.own_signals)
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as err:
        raise_as_interrupt(err)      # an error a signal caused is the signal (on_signals)
        return report_error(err)
    return 0


def entry_main() -> int:
    """:func:`main` under TCMalloc when it is installed, else with glibc's malloc tuned to
    reuse what it frees (a faster step on CPU, dagmoe_jax/run/allocator.py). The entries set
    the allocator up before the stop contract's watcher thread starts (:func:`entry`,
    ``train.py``, ``dagmoe_jax.cli.entry``); here it is a no-op then."""
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()
    return main()


def entry() -> int:
    """``python -m dagmoe_jax.cli.train``: the allocator set up first, then :func:`entry_main`
    under the stop contract (:func:`dagmoe_jax.stopping.run_command`: after the command,
    signals are ignored through the interpreter's shutdown, where a SIGTERM killed a run that
    had stopped cleanly; a stopped start-up ends without that shutdown, which crashed with its
    abandoned compilation and prefetch threads still running)."""
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()   # before the contract's watcher thread (train.py says why)
    return stopping.run_command(entry_main)


if __name__ == "__main__":
    sys.exit(entry())
