"""Score a run directory on lm-evaluation-harness tasks.

    python -m dagmoe_jax.harness --run_dir runs/dagmoe_s --tasks piqa,arc_easy,hellaswag \\
        --batch_size 16 --output_path results/dagmoe_s
    python -m dagmoe_jax.harness --run_dir R --tasks dagmoe_mc --include_path tests/harness_tasks

Flags (the harness's own, as ``lm_eval run`` spells them):
  --run_dir=DIR           a run directory (train.py, the upcycle command, a DUME merge), or
                          hf:FOLDER, a Hugging Face Llama folder with its tokenizer.json
  --tasks=T1,T2           task or group names (``lm_eval ls tasks`` lists the harness's)
  --num_fewshot=N         few-shot examples per prompt (default: each task's own)
  --limit=N               only the first N documents of each task (N < 1: that fraction)
  --batch_size=N|auto     rows per compiled call (default 8); auto: the largest power of two
                          up to --max_batch_size whose compiled call fits the device's memory
  --max_batch_size=N      the most rows auto may choose (default 64, lm_eval's)
  --model_args=K=V,...    the model's arguments as lm_eval spells them: add_bos_token,
                          prefix_token_id, dtype (float32 or bfloat16 compute), max_gen_toks
                          (HFLM's; trust_remote_code is refused, by name); the flags above
                          take precedence
  --max_length=N          the scoring window (default: the model's max_seq_len)
  --include_path=DIR      also read task YAML files from DIR (local or offline tasks)
  --output_path=PATH      write the harness's results JSON (and samples) under PATH, in a
                          folder named after the run (its directory's name and step:
                          PATH/dagmoe_s_step23842/results_DATE.json; the path is printed)
  --log_samples           also write every document's prompt, answers and scores
  --apply_chat_template   format prompts with the tokenizer's chat template (a name picks one
                          of several); --fewshot_as_multiturn=false turns few-shot examples
                          into one user turn instead of a conversation
  --system_instruction=S  a system message before every prompt
  --gen_kwargs=K=V,...    override generation settings (max_gen_toks, temperature, do_sample)
  --seed=S                the seeds as ``lm_eval run`` reads them: python,numpy,torch,fewshot
                          (default 0,1234,1234,1234, lm_eval's; one integer sets all four,
                          'None' leaves one unset); the torch slot seeds sampled generation
  --prefix_eos            put the EOS id before every context and prompt
  --confirm_run_unsafe_code
                          let tasks run the model's code (HumanEval, MBPP), as lm_eval asks
  --mesh=auto|none        data-parallel over every device (auto, default) or one device
  --bootstrap_iters=N     bootstrap resamples for the standard errors (default 100000)
  --metadata=JSON         a JSON object joined to every task's metadata (lm_eval run's
                          --metadata, merged with --model_args as it merges them): what
                          tasks such as RULER read, e.g. '{"max_seq_lengths": [4096]}'

Prints the harness's table. Exit status: 0 done, 2 bad arguments, run directory or task (one
line), 3 lm-evaluation-harness not installed (the ``[harness]`` extra: ``pip install -e
'.[harness]'`` in a checkout; a plain ``pip install -e .`` leaves it out).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dagmoe_jax.command_line import (USER_ERRORS, OneLineParser, parse_or_report,
                                     quiet_background_errors, report_error)
from dagmoe_jax.stopping import (output_complete, remove_on_stop, run_command,
                                 set_stop_message)

STOPPED = "the evaluation stopped; no results were written"
INSTALL_HINT = ("lm-evaluation-harness is not installed: install the [harness] extra, "
                "pip install -e '.[harness]' in a checkout (pip install -e . leaves it out) or "
                "pip install 'dagmoe-jax[harness]'")


DEFAULT_SEEDS = "0,1234,1234,1234"   # lm_eval run's --seed: python, numpy, torch, few-shot


def seeds(text: str) -> list:
    """``--seed`` as ``lm_eval run`` parses it: one integer (or 'None') for all four slots
    (python, numpy, torch, few-shot), or three or four comma-separated ones, a missing fourth
    taken from :data:`DEFAULT_SEEDS`."""
    def one(item: str):
        item = item.strip().lower()
        if item == "none":
            return None
        try:
            return int(item)
        except ValueError:
            raise ValueError(f"--seed={text} is invalid: {item!r} is not an integer or None "
                             f"(expected N or python,numpy,torch,fewshot)") from None

    items = [one(v) for v in text.split(",")]
    if len(items) == 1:
        return items * 4
    if not 3 <= len(items) <= 4:
        raise ValueError(f"--seed={text} is invalid: expected one value or 3-4 comma-separated "
                         f"values (python,numpy,torch,fewshot)")
    return items + [one(v) for v in DEFAULT_SEEDS.split(",")][len(items):]


def batch_size(text: str):
    """``--batch_size`` as ``lm_eval run`` takes it: an integer >= 1, 'auto' or 'auto:N' (the
    harness's re-detection N times over; here the size is chosen once, from the compiled
    program's memory, so 'auto:N' is 'auto')."""
    if text == "auto" or text.startswith("auto:"):
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--batch_size={text} is invalid: expected an integer >= 1 or auto")
    return value


def model_args(text: str) -> dict:
    """``--model_args`` as lm_eval parses it (``K=V,K=V``, values typed as it types them)."""
    if not text.strip():
        return {}
    from lm_eval.utils import simple_parse_args_string  # pylint: disable=import-outside-toplevel
    try:
        return simple_parse_args_string(text)
    except ValueError:
        raise ValueError(f"--model_args={text} is invalid: expected KEY=VALUE pairs separated "
                         "by commas") from None


def metadata(text: str) -> dict:
    """``--metadata``: a JSON object ('' or absent: none)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"--metadata={text} is invalid: expected a JSON object, e.g. "
                         """--metadata='{"max_seq_lengths": [4096, 8192]}'""")
    return value


def results_folder(run_dir: str, step: int) -> str:
    """The folder under ``--output_path`` that holds a run's results (lm-eval names it after
    the model): the run directory's name and step (``dagmoe_s_step200``), a Hugging Face
    folder's name alone."""
    # pylint: disable=import-outside-toplevel
    from lm_eval.utils import sanitize_model_name
    from dagmoe_jax.hf.run import hf_folder, is_hf

    hf = is_hf(run_dir)
    name = os.path.basename(os.path.normpath(hf_folder(run_dir))) or "run"
    return sanitize_model_name(name if hf else f"{name}_step{step}")


def save_results(tracker, results: dict, samples, run_dir: str, folder: str, log) -> None:
    """Write ``results`` (and ``samples``) with lm-eval's tracker into ``folder`` under its
    output path and say where; lm-eval's tracker only warns when it cannot write, and so does
    this, after the evaluation. The files are written into a hidden directory and moved into
    place when complete (:func:`dagmoe_jax.run.paths.staged_directory`, what was there kept),
    so a stopped write leaves no half-written results file."""
    from dagmoe_jax.run.paths import staged_directory  # pylint: disable=import-outside-toplevel
    config = tracker.general_config_tracker
    config.model_name, config.model_name_sanitized = run_dir, folder
    path, target = output_paths(tracker.output_path)
    try:
        with staged_directory(target, merge=True) as stage:
            tracker.output_path = str(stage / path.name if path.suffix == ".json" else stage)
            try:
                tracker.save_results_aggregated(results=results, samples=samples)
                if samples is not None:
                    for name in results["configs"]:
                        tracker.save_results_samples(task_name=name, samples=samples[name])
            finally:
                tracker.output_path = str(path)
    except ValueError as err:                 # the scores are printed all the same
        log(f"warning: the results could not be written: {err}")
        return
    date = getattr(tracker, "date_id", "")
    written = (path.with_name(f"{path.stem}_{date}.json") if path.suffix == ".json" else
               path / folder / f"results_{date}.json")
    if date and written.is_file():
        log(f"results written to {written}"
            + (" (samples beside it)" if samples is not None else ""))
    else:
        log(f"warning: the results could not be written under {tracker.output_path} (see "
            "lm-eval's warning above): check that the path is writable")


def output_paths(output_path: str):
    """(``--output_path`` as an absolute path, the directory lm-eval writes into: its parent
    for a ``.json`` path, else itself)."""
    path = Path(output_path).expanduser().absolute()
    return path, (path.parent if path.suffix == ".json" else path)


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def parse_args(argv):
    parser = OneLineParser(add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--run_dir", default="")
    parser.add_argument("--tasks", default="")
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None)
    parser.add_argument("--batch_size", default="8")
    parser.add_argument("--max_batch_size", type=int, default=64)
    parser.add_argument("--model_args", default="")
    parser.add_argument("--max_length", type=int, default=None)
    parser.add_argument("--include_path", default=None)
    parser.add_argument("--output_path", default=None)
    parser.add_argument("--log_samples", action="store_true")
    parser.add_argument("--apply_chat_template", nargs="?", const=True, default=False)
    parser.add_argument("--fewshot_as_multiturn", type=_bool, default=True)
    parser.add_argument("--system_instruction", default=None)
    parser.add_argument("--gen_kwargs", default=None)
    parser.add_argument("--seed", default=DEFAULT_SEEDS)
    parser.add_argument("--prefix_eos", action="store_true")
    parser.add_argument("--confirm_run_unsafe_code", action="store_true")
    parser.add_argument("--mesh", choices=("auto", "none"), default="auto")
    parser.add_argument("--bootstrap_iters", type=int, default=100000)
    parser.add_argument("--metadata", default="")
    args = parser.parse_args(argv)
    if not args.help:
        if not args.run_dir:
            raise ValueError("--run_dir=DIR is required (a run directory written by train.py, "
                             "or hf:FOLDER)")
        if not args.tasks:
            raise ValueError("--tasks=T1,T2 is required (lm_eval ls tasks lists them)")
        if args.log_samples and not args.output_path:
            raise ValueError("--log_samples needs --output_path=PATH to write the samples to")
        args.batch_size = batch_size(args.batch_size)
        if args.max_batch_size < 1:
            raise ValueError(f"--max_batch_size={args.max_batch_size} is invalid: expected >= 1")
        args.model_args = model_args(args.model_args)
        args.metadata = metadata(args.metadata)
        if args.limit is not None and args.limit <= 0:
            raise ValueError(f"--limit={args.limit} is invalid: expected > 0")
        if args.limit is not None and args.limit >= 1:
            args.limit = int(args.limit)
        args.seed = seeds(args.seed)
    return args


def evaluate(args, log=print) -> dict:
    """Run the harness on ``args`` (parsed flags); returns its results dict (samples
    removed), after writing them under ``--output_path`` when given."""
    # pylint: disable=import-outside-toplevel
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    from dagmoe_jax.config.blocks import block_summary
    from dagmoe_jax.harness.lm import DagmoeLM
    from dagmoe_jax.harness.task_loading import load_tasks
    from dagmoe_jax.harness.task_loading import task_manager as make_task_manager

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    task_metadata = {**args.model_args, **args.metadata}       # as lm_eval run merges them
    task_manager = make_task_manager(args.include_path, tasks, task_metadata)
    unknown = [t for t in tasks if t not in task_manager.all_tasks]
    if unknown:
        where = f" or in {args.include_path}" if args.include_path else ""
        raise ValueError(f"unknown task {unknown[0]!r}: not among the harness's tasks{where} "
                         f"(lm_eval ls tasks lists them; --include_path adds a folder)")
    # every bad task is one line now, before the model loads
    load_tasks(task_manager, tasks, args.confirm_run_unsafe_code)
    options = dict(args.model_args)
    if "run_dir" in options:
        raise ValueError("--model_args run_dir=... is refused: pass --run_dir=DIR")
    options.update(batch_size=args.batch_size, max_batch_size=args.max_batch_size,
                   mesh=args.mesh, prefix_eos=args.prefix_eos, seed=args.seed[2] or 0)
    if args.max_length is not None:
        options["max_length"] = args.max_length
    lm = DagmoeLM(run_dir=args.run_dir, **options)
    if args.batch_size == "auto":
        log(f"batch size auto: {lm.scorer.batch_size} rows (the largest that fits, at most "
            f"{args.max_batch_size})")
    log(f"run {args.run_dir} at step {lm.run.step}: {block_summary(lm.run.model_cfg.block)}, "
        f"{lm.run.data_cfg.tokenizer} tokenizer, window {lm.max_length}, "
        f"batch {lm.scorer.batch_size}, mesh {'none' if lm.scorer.mesh is None else 'auto'}")
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
        batch_size=lm.scorer.batch_size, log_samples=args.log_samples,
        evaluation_tracker=tracker, system_instruction=args.system_instruction,
        apply_chat_template=args.apply_chat_template,
        fewshot_as_multiturn=args.fewshot_as_multiturn if args.apply_chat_template else False,
        gen_kwargs=args.gen_kwargs, task_manager=task_manager,
        bootstrap_iters=args.bootstrap_iters, random_seed=args.seed[0],
        numpy_random_seed=args.seed[1], torch_random_seed=args.seed[2],
        fewshot_random_seed=args.seed[3],
        confirm_run_unsafe_code=args.confirm_run_unsafe_code, metadata=task_metadata)
    samples = results.pop("samples", None)
    if tracker is not None:
        folder = results_folder(args.run_dir, lm.run.step)
        _, target = output_paths(tracker.output_path)
        from dagmoe_jax.run.paths import partial_path  # pylint: disable=import-outside-toplevel
        remove_on_stop(target)              # what appears there from now on, on a signal
        remove_on_stop(partial_path(target, merge=True))
        save_results(tracker, results, samples if args.log_samples else None, args.run_dir,
                     folder, log)
        output_complete()
    return results


def main(argv=None) -> int:
    set_stop_message(STOPPED)
    args, code = parse_or_report(parse_args, argv, __doc__)
    if args is None:
        return code
    try:
        import lm_eval.utils  # noqa: F401  pylint: disable=import-outside-toplevel
    except ImportError:
        print(f"error: {INSTALL_HINT}", file=sys.stderr)
        return 3
    quiet_background_errors()
    try:
        results = evaluate(args, log=lambda message: print(message, file=sys.stderr, flush=True))
    except USER_ERRORS as err:
        return report_error(err)
    from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


def entry() -> None:
    """The ``dagmoe-harness`` command under the stop contract."""
    sys.exit(run_command(main))
