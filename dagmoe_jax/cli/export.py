"""Export a trained run as a Hugging Face directory, its tokenizer included: a dense run as a
Llama, an MoE run as Mixtral, OLMoE or Qwen3-MoE.

    python -m dagmoe_jax.cli.export --run_dir=runs/dense --out=exports/dense
    dagmoe-export --run_dir=runs/dense --out=exports/dense --dtype=bfloat16 --max_shard_mb=2000

Flags:
  --run_dir=DIR       a train.py or dagmoe-import run directory of a dense model
                      (ModelConfig.block = 'dense') or of an MoE (block = 'moe') that one of
                      the families computes (:func:`dagmoe_jax.hf.export.hf_family`: by its
                      q/k norms, none Mixtral, 'full' OLMoE, 'head' Qwen3-MoE; softmax router,
                      sum aggregation, no shared experts, dropless)
  --out=DIR           the Hugging Face directory to write (it must not exist, or be empty)
  --dtype=NAME        float32 (default) or bfloat16 weights
  --max_shard_mb=N    safetensors shards of at most N MB with an index (default: one file)

Writes ``config.json`` and ``model.safetensors`` (:func:`dagmoe_jax.hf.export.export_run`
through :func:`~dagmoe_jax.hf.export.export_hf`: the newest checkpoint's parameters in the
family's names and config fields, the tokenizer's BOS and EOS ids, the LM head tied when it
equals the embedding) and the run's tokenizer (:mod:`dagmoe_jax.hf.tokenizer`: for the byte
tokenizer a ``tokenizer.json`` that gives exactly its ids). The directory is written beside
``--out`` and moved there when complete, so an interrupted export leaves nothing at ``--out``.
``transformers``, ``train.py --gin.RunConfig.init_from='hf:DIR'``, ``dagmoe-import`` and the
harness's ``--run_dir=hf:DIR`` read it (``dagmoe-upcycle --dense=DIR`` a Llama).
Exit status: 0 done, 2 invalid arguments or run directory (a one-line message), 130 when
interrupted (Ctrl-C: the partial folder is removed).
"""

from __future__ import annotations

import sys

from dagmoe_jax.command_line import OneLineParser, check_new_directory, write_command
from dagmoe_jax.stopping import remove_on_stop, run_command

DTYPES = ("float32", "bfloat16")


def parse_args(argv):
    parser = OneLineParser(add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--run_dir", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max_shard_mb", type=int, default=0)
    args = parser.parse_args(argv)
    if args.help:
        return args
    if not args.run_dir or not args.out:
        raise ValueError("--run_dir=DIR (a dense or MoE train.py run) and --out=DIR are "
                         "required")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype={args.dtype} is invalid: expected one of {', '.join(DTYPES)}")
    if args.max_shard_mb < 0:
        raise ValueError(f"--max_shard_mb={args.max_shard_mb} is invalid: expected >= 0")
    check_new_directory("out", args.out)
    return args


def main(argv=None) -> int:
    return write_command(parse_args, argv, __doc__, _export, lambda a: a.out)


def _export(args, log) -> None:
    # after parsing: --help does not wait for JAX
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax.hf.export import export_run
    from dagmoe_jax.run.paths import partial_path
    remove_on_stop(partial_path(args.out))
    export_run(args.run_dir, args.out, dtype=args.dtype, max_shard_mb=args.max_shard_mb,
               log=log)


if __name__ == "__main__":
    sys.exit(run_command(main))
