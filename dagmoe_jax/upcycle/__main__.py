"""Merge dense expert models into one DUME MoE (seed 004) and write a run directory.

    python -m dagmoe_jax.upcycle --run_dir=runs/dume \\
        --dense=runs/code --source='text:corpus/code/*.txt' \\
        --dense=runs/math --source='text:corpus/math/*.txt' \\
        --dense=runs/law  --source='text:corpus/law/*.txt' [--top_k=2] [--stats_batches=32]

Flags:
  --dense=DIR            a dense model: a train.py run directory or a Hugging Face Llama
                         directory (config.json + safetensors; also spelled hf:DIR).
                         Repeatable, one per domain.
  --source=SPEC          that domain's data (a DataConfig source spec), in --dense order
  --run_dir=DIR          the new run directory (it must not exist, or be empty); written
                         beside it and moved there when complete
  --router=dume|random   dume (default): closed-form ridge routers (DUME eqs. 2-7);
                         random: a random router (the random-routing baseline; BTX's start)
  --top_k=K              experts per token (default 1, the dense models' cost)
  --temperature=T        softmax temperature of the gate (default 1; the authors' reasoning
                         scripts use 0.1, their language-modelling ones 1)
  --lam=L                ridge lambda (default 1e-2, absolute)
  --stats_text=prompts|stream
                         what the statistics read (DUME eq. 7). prompts (default; the
                         authors' reading, gensyn-ai/dume reasoning_generate_dume_params.py):
                         each example's prompt alone (an instruction record's user turn, a
                         text record's text), with the BOS the tokenizer adds, its first
                         --stats_tokens tokens a row of its own, the first --stats_examples
                         examples of the source (name the evaluated split itself as --source
                         for their use_test_distribution). stream: the domain's training
                         stream as train.py reads it (conversations rendered in the chat
                         template and packed, every token counted; --stats_batches batches)
  --stats_examples=N     prompts: examples per domain (default 2048, the authors')
  --stats_tokens=N       prompts: the first N tokens of each example (default 1024, the
                         authors' --num_dume_tokens)
  --stats_batches=N      stream: batches per domain for the statistics (default 16)
  --tokens_per_sequence=N  stream: only the first N tokens of each row count (default: all)
  --dag_dim=G --dag_iters=L  also upcycle into a DAG-MoE (G > 0) that starts equal to DUME
  --steps=N              steps the written run trains for when continued (default 1000)
  --trainable=SET        what the continuation trains (RunConfig.trainable): default 'router'
                         (DUME+) for top_k >= 2; at top_k 1 (the router gets no gradient: the
                         gate of one expert is 1) 'router_and_gates', the authors' set (routers
                         + each expert's w_gate); 'all' for a DAG; or 'all', 'non_experts',
                         'aggregator' (a DAG's aggregator only: DUME+'s analogue)
  --dag_init=model|fan_in  the DAG's W_down, W_edge, W_node: init_std (default; its messages
                         are ~1e-3 and barely train) or N(0, 1/fan-in) (W_up stays 0)
  --tokenizer_path=FILE  tokenizer.json for Hugging Face models (default: DIR/tokenizer.json
                         of the first --dense)
  --seq_len=N --batch_size=N  rows of the stream statistics and of later training (default:
                         the first dense run's; 1024 and 16 for Hugging Face models)
  --dtype=float32|bfloat16  what the merged parameters are held in (default float32).
                         bfloat16: half the memory; the statistics pass reads the bfloat16
                         weights (computing in float32) and accumulates X~^T X~ in float32; the
                         checkpoint holds the bfloat16 parameters, which evaluation and the
                         resuming run read into float32 master weights

Memory: with Hugging Face --dense directories (merged one tensor at a time) the command's peak
host memory is the merged MoE (its shared weights once, every expert's MLP) plus the per-domain
statistics (float64, layers x (d+1)^2 each) plus one parameter's transient copies, and
while the checkpoint is written the arrays Orbax is encoding (its concurrency limit); the
measured peak against the experts' summed size is in benchmarks/RESULTS.md
(benchmarks/merge_memory.py). The run is written from the merged parameters without building a
second model; its step 0 holds no optimizer state (train.py creates it when it resumes).
Dense train.py runs are loaded whole first (their summed size on top).

Then: python train.py --mode=eval --run_dir=DIR; python -m dagmoe_jax.cli.sample --run_dir=DIR;
python train.py --gin_file=DIR/resume.gin (DUME+ at top_k >= 2). Exit status 2 for invalid input
(one line).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from dagmoe_jax.command_line import (USER_ERRORS, OneLineParser, check_new_directory,
                                     parse_or_report, quiet_background_errors, report_error)
from dagmoe_jax.stopping import (output_complete, remove_on_stop, run_command,
                                 set_stop_message)


def parse_args(argv):
    p = OneLineParser(add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--dense", action="append", default=[])
    p.add_argument("--source", action="append", default=[])
    p.add_argument("--run_dir", default="")
    p.add_argument("--router", default="dume", choices=("dume", "random"))
    p.add_argument("--top_k", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=1e-2)
    p.add_argument("--stats_text", default="prompts", choices=("prompts", "stream"))
    p.add_argument("--stats_examples", type=int, default=2048)
    p.add_argument("--stats_tokens", type=int, default=1024)
    p.add_argument("--stats_batches", type=int, default=16)
    p.add_argument("--tokens_per_sequence", type=int, default=None)
    p.add_argument("--dag_dim", type=int, default=0)
    p.add_argument("--dag_iters", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--trainable", default="",
                   choices=("", "all", "router", "router_and_gates", "non_experts",
                            "aggregator"))
    p.add_argument("--dag_init", default="model", choices=("model", "fan_in"))
    p.add_argument("--tokenizer_path", default="")
    p.add_argument("--seq_len", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    return p.parse_args(argv)


def _check_args(args) -> None:
    if not args.run_dir:
        raise ValueError("--run_dir is required: the run directory to write")
    if len(args.dense) < 1:
        raise ValueError("give at least one --dense model directory (one per domain)")
    # hf:FOLDER, as every command spells a Hugging Face folder; a folder is known by its
    # config.json here either way.
    from dagmoe_jax.hf.run import hf_folder  # pylint: disable=import-outside-toplevel
    args.dense = [hf_folder(d) for d in args.dense]
    if len(args.source) != len(args.dense):
        raise ValueError(f"{len(args.dense)} --dense models but {len(args.source)} --source "
                         f"specs: give one --source per --dense, in the same order")
    check_new_directory("run_dir", args.run_dir)
    for name in ("stats_batches", "stats_examples", "stats_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} is invalid: expected >= 1")
    if args.steps < 1:
        raise ValueError(f"--steps={args.steps} is invalid: expected >= 1")
    if args.trainable == "router" and args.top_k == 1:
        raise ValueError("--trainable=router with --top_k=1: the gate of the one chosen expert "
                         "is always 1, so the router gets no gradient; use --top_k=2 (DUME+) "
                         "or --trainable=router_and_gates")


def _base_data(args, base):
    from dagmoe_jax.data import DataConfig  # pylint: disable=import-outside-toplevel
    from dagmoe_jax.hf.llama import tokenizer_settings  # pylint: disable=import-outside-toplevel

    if base is None:       # a Hugging Face model: its tokenizer.json and tokenizer_config.json
        path = args.tokenizer_path or str(Path(args.dense[0]) / "tokenizer.json")
        if not Path(path).is_file():
            raise ValueError(f"{path} does not exist: pass --tokenizer_path=tokenizer.json of "
                             f"the Hugging Face models")
        eos = tokenizer_settings(Path(path).parent).get("eos_token", "")
        # absolute: the run it writes is scored and sampled from any working directory
        base = DataConfig(tokenizer="hf", tokenizer_path=str(Path(path).expanduser().resolve()),
                          eos_token=eos, seq_len=1024)      # the authors' context length
    changes = {k: v for k, v in (("seq_len", args.seq_len), ("batch_size", args.batch_size)) if v}
    return dataclasses.replace(base, **changes)


def run(args) -> Path:
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax.run.paths import partial_path
    from dagmoe_jax.upcycle import command, dume

    _check_args(args)
    start = time.perf_counter()
    if all(command.is_hf_dir(p) for p in args.dense):   # merged one tensor at a time
        print(f"merging {len(args.dense)} Hugging Face models", file=sys.stderr, flush=True)
        dense, base = list(args.dense), _base_data(args, None)
    else:
        dense = []
        for path in args.dense:
            print(f"loading {path}", file=sys.stderr, flush=True)
            dense.append(command.load_dense(path))
        base = _base_data(args, dense[0].data_cfg)
    domains = [command.domain_data(base, s) for s in args.source]

    prompts = args.stats_text == "prompts"
    if prompts:
        batches = [lambda d=d: command.prompt_batches(d, max_examples=args.stats_examples,
                                                      max_tokens=args.stats_tokens)
                   for d in domains]
    else:
        batches = [lambda d=d: command.domain_batches(d, args.stats_batches) for d in domains]

    def progress(j, b, t):
        # the cursor back at the line's start after each update: a line printed next (a
        # signal's stop line) starts there
        print(f"statistics: domain {j + 1}/{len(domains)} ({args.source[j]}): batch {b}, "
              f"{t} tokens, {time.perf_counter() - start:.0f} s", end="\r", file=sys.stderr,
              flush=True)

    moe, cfg, stats = command.build_dume(
        dense, batches, top_k=args.top_k, temperature=args.temperature, lam=args.lam,
        tokens_per_sequence=None if prompts else args.tokens_per_sequence,
        router=args.router, seed=args.seed, dtype=args.dtype, progress=progress)
    print(file=sys.stderr, flush=True)
    if args.dag_dim > 0:
        moe = dume.upcycle_to_dag(moe, dag_dim=args.dag_dim, dag_iters=args.dag_iters,
                                  seed=args.seed, fan_in=args.dag_init == "fan_in")
        cfg = cfg.replace(block=dict(aggregation=moe.cfg.block.aggregation))
    summary = {"dense": args.dense, "sources": args.source, "router": args.router,
               "top_k": args.top_k, "temperature": args.temperature, "lambda": args.lam,
               "tokens_per_domain": [s.tokens for s in stats],
               "stats_text": args.stats_text,
               "stats_examples": args.stats_examples if prompts else None,
               "stats_tokens": args.stats_tokens if prompts else None,
               "tokens_per_sequence": None if prompts else args.tokens_per_sequence,
               "dag_dim": args.dag_dim, "dtype": args.dtype}
    trainable = args.trainable or command.default_trainable(cfg)
    if not args.trainable and trainable == "router_and_gates":
        print(command.TOP1_NOTE, file=sys.stderr, flush=True)
    summary["trainable"] = trainable
    set_stop_message(f"nothing was written at {args.run_dir}")
    remove_on_stop(args.run_dir, threaded=True)     # the checkpoint: an Orbax save, into
    remove_on_stop(partial_path(args.run_dir), threaded=True)   # the sibling moved there
    out = command.write_run(args.run_dir, moe, cfg, command.mixed_data(base, args.source),
                            steps=args.steps, trainable=trainable, stats=stats,
                            summary=summary)
    output_complete()
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s): evaluate with python train.py "
          f"--mode=eval --run_dir={out}; continue training with python train.py "
          f"--gin_file={out / command.RESUME_GIN}", flush=True)
    return out


def main(argv=None) -> int:
    args, code = parse_or_report(parse_args, argv, __doc__)
    if args is None:
        return code
    quiet_background_errors()
    try:
        run(args)
    except USER_ERRORS as err:
        return report_error(err)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
