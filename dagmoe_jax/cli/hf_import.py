"""Import a Hugging Face Llama folder as a dense run directory, or a Mixtral, OLMoE or
Qwen3-MoE folder as an MoE run (:mod:`dagmoe_jax.hf.moe`).

    python -m dagmoe_jax.cli.hf_import --hf=models/Llama-3.2-1B --run_dir=runs/llama1b
    dagmoe-import --hf=models/Llama-3.2-1B --run_dir=runs/llama1b --seq_len=2048 \\
        --source='text:corpus/*.txt' --steps=2000

Flags:
  --hf=DIR            a Hugging Face Llama, Mixtral, OLMoE or Qwen3-MoE folder: config.json,
                      model.safetensors (or shards with their index) and tokenizer.json
                      (tokenizer_config.json, generation_config.json and a chat template
                      beside it are kept)
  --run_dir=DIR       the run directory to write (it must not exist, or be empty)
  --seq_len=N         the run's sequence length (default 1024, at most the model's context)
  --batch_size=N      its batch size (default 16)
  --source=SPEC       its data source (a DataConfig source spec; default DataConfig's)
  --steps=N           steps ``resume.gin`` trains for (default 1000)
  --to_dag            an MoE folder becomes a DAG-MoE (DAG-MoE eq. 6-12 over its experts'
                      outputs): the DAG module is added with W_up = 0, so the run computes
                      the folder's logits until training moves it
  --dag_dim=N --dag_iters=L   the DAG module's d_g (default 128) and iterations (default 2)
  --to_coe            an MoE folder becomes a Chain-of-Experts (CoE eq. 4-7, inner residual)
                      over its experts: the first iteration routes as the folder does, the
                      later ones start from a copy of its router at weight a_t = 0, so the run
                      computes the folder's logits until training moves them
                      (:mod:`dagmoe_jax.families.moe.conversion`)
  --coe_iters=C       the chain's iterations (default 2)

Writes a run like any other: a Llama as a dense block (``ModelConfig.block = 'dense'``: no
router, no statistics), a Mixtral, OLMoE or Qwen3-MoE as the MoE block with the family's
routing and attention details (:mod:`dagmoe_jax.hf.moe`), from
:func:`dagmoe_jax.hf.llama.load_hf_llama`, read a tensor at a time;
step 0 holds the parameters alone (the run that continues creates the optimizer's state);
``config.json`` with the tokenizer's files copied into ``DIR/tokenizer/`` (recorded by absolute
path and SHA-256, so the run does not depend on the folder afterwards); ``resume.gin``. Then::

    python train.py --gin_file=DIR/resume.gin          # continue pre-training it
    python train.py --gin.RunConfig.init_from="'DIR'" ...   # fine-tune from it
    python -m dagmoe_jax.harness --run_dir=DIR ...     # score it; dagmoe-sample, dagmoe-export,
    python -m dagmoe_jax.upcycle --dense=DIR ...       # and upcycle it, as any dense run

The run is written beside ``--run_dir`` (a hidden ``.NAME.partial``) and moved there when
complete, so a failed or interrupted import leaves nothing at ``--run_dir``.
Exit status: 0 done, 2 invalid arguments or folder (a one-line message), 130 when interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dagmoe_jax.command_line import OneLineParser, check_new_directory, write_command
from dagmoe_jax.stopping import remove_on_stop, run_command

DEFAULT_SEQ_LEN = 1024


def parse_args(argv):
    parser = OneLineParser(add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--hf", default="")
    parser.add_argument("--run_dir", default="")
    parser.add_argument("--seq_len", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--source", default=None)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--to_dag", action="store_true")
    parser.add_argument("--dag_dim", type=int, default=128)
    parser.add_argument("--dag_iters", type=int, default=2)
    parser.add_argument("--to_coe", action="store_true")
    parser.add_argument("--coe_iters", type=int, default=2)
    args = parser.parse_args(argv)
    if args.help:
        return args
    if not args.hf or not args.run_dir:
        raise ValueError("--hf=DIR (a Hugging Face Llama or MoE folder) and --run_dir=DIR are "
                         "required")
    for name in ("seq_len", "batch_size", "steps"):
        value = getattr(args, name)
        if value < (0 if name == "seq_len" else 1):
            raise ValueError(f"--{name}={value} is invalid: expected an integer >= 1")
    check_new_directory("run_dir", args.run_dir)
    args.convert_to = _convert_to(args)
    return args


def import_hf(folder: str, run_dir: str, *, seq_len: int = 0, batch_size: int = 16,
              source=None, steps: int = 1000, convert_to=None, log=print) -> Path:
    """Write ``folder`` (a Hugging Face Llama or MoE) as the run ``run_dir`` (module docstring);
    returns the run's path; ``convert_to``: the block an MoE folder is converted to
    (:func:`dagmoe_jax.hf.llama.load_hf_llama`), or a function of the folder's ModelConfig
    giving it. One-line ``ValueError`` for a folder that is
    no Llama or has no ``tokenizer.json``, and for a ``seq_len`` beyond the model's context."""
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.data.tokenizers import make_tokenizer
    from dagmoe_jax.hf.llama import load_hf_llama, model_config_from_hf, read_hf_config
    from dagmoe_jax.hf.run import folder_tokenizer
    from dagmoe_jax.run.config import OptimConfig, RunConfig
    from dagmoe_jax.run.paths import staged_directory

    source_dir = Path(folder).expanduser().resolve()
    folder_tokenizer(source_dir)
    folder_cfg = model_config_from_hf(read_hf_config(source_dir))
    context = folder_cfg.max_seq_len
    seq_len = seq_len or min(DEFAULT_SEQ_LEN, context)
    if seq_len > context:                        # before anything is read or written
        raise ValueError(f"--seq_len={seq_len} is longer than the model's context "
                         f"({context} positions): at most that")
    # the tokenizer's files read as the run will read them, before anything is written (a
    # damaged tokenizer.json or tokenizer_config.json would be copied into the run)
    make_tokenizer(DataConfig(tokenizer="hf", tokenizer_path=str(source_dir / "tokenizer.json"),
                              seq_len=seq_len))
    target = Path(run_dir).expanduser().resolve()
    with staged_directory(target) as path:    # moved to target when complete
        data_cfg = run_lib.copy_tokenizer(DataConfig(
            tokenizer="hf", tokenizer_path=str(source_dir / "tokenizer.json"),
            seq_len=seq_len, batch_size=batch_size,
            **({} if source is None else {"source": source})), path)
        staged_tokenizer = data_cfg.tokenizer_path           # recorded where it will be
        data_cfg = data_cfg.replace(tokenizer_path=str(
            target / Path(staged_tokenizer).relative_to(path)))
        copied = [name for name in run_lib.TOKENIZER_FILES
                  if (path / run_lib.TOKENIZER_DIR / name).is_file()]
        if callable(convert_to):
            convert_to = convert_to(folder_cfg)
        model, model_cfg = load_hf_llama(source_dir, convert_to=convert_to)
        optim_cfg = OptimConfig()
        run_cfg = RunConfig(run_dir=str(target), steps=steps, save_every=steps)
        run_lib.save_initial_checkpoint(path, model, None, model_cfg, run_cfg, None)
        run_lib.save_resume_gin(path, model_cfg, data_cfg, optim_cfg, run_cfg)
        run_lib.save_configs(path, model_cfg, data_cfg, optim_cfg, run_cfg,
                             settled=model.execution, tokenizer_file=staged_tokenizer)
    log(f"imported {source_dir} into {target}: {model_cfg.block.describe()}, "
        f"{model_cfg.num_layers} layers, d_model "
        f"{model_cfg.d_model}, vocabulary {model_cfg.vocab_size}; tokenizer files: "
        f"{', '.join(copied)}")
    return target


def main(argv=None) -> int:
    return write_command(parse_args, argv, __doc__, _import, lambda a: a.run_dir,
                         threaded=True)   # the step-0 checkpoint: an Orbax save


def _import(args, log) -> None:
    from dagmoe_jax.run.paths import partial_path  # pylint: disable=import-outside-toplevel
    remove_on_stop(partial_path(args.run_dir), threaded=True)
    import_hf(args.hf, args.run_dir, seq_len=args.seq_len, batch_size=args.batch_size,
              source=args.source, steps=args.steps, convert_to=args.convert_to, log=log)


def _convert_to(args):
    """What ``--to_dag`` or ``--to_coe`` asks for: the DAG-MoE block, or a function of the
    folder's ModelConfig giving the CoE block (its K is the folder's); else None. One-line
    ValueError for bad sizes or both."""
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax.families.moe.config import AggregationConfig, MoEConfig
    from dagmoe_jax.families.moe.conversion import coe_request
    if args.to_dag and args.to_coe:
        raise ValueError("--to_dag and --to_coe are two conversions: give one")
    if args.to_dag:
        return MoEConfig(aggregation=AggregationConfig(kind="dag", dag_dim=args.dag_dim,
                                                       dag_iters=args.dag_iters))
    if args.to_coe:
        if args.coe_iters < 1:
            raise ValueError(f"--coe_iters={args.coe_iters} is invalid: expected an integer "
                             f">= 1")
        return lambda source: coe_request(source, args.coe_iters)
    return None


if __name__ == "__main__":
    sys.exit(run_command(main))
