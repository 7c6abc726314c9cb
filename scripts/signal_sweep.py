"""Ctrl-C at every moment of a command: does it always end cleanly?

    python scripts/signal_sweep.py                          # train.py: every 0.5 s until it trains
    python scripts/signal_sweep.py --finetune --every 1     # fine-tuning from a 2-step run
    python scripts/signal_sweep.py --delays 3,6,9 --parallel 3 --json out.json
    python scripts/signal_sweep.py --command=export         # another command (COMMANDS)
    python scripts/signal_sweep.py --command=all --fixtures=/tmp/sweep

``train.py``: each moment starts the smoke run (``configs/train/smoke.gin``; with
``--finetune``, ``configs/finetune/smoke.gin`` from a 2-step smoke run made first) in a fresh
run directory and a session of its own, and sends SIGINT to its whole process group after that
many seconds, as Ctrl-C in a terminal does. A moment passes when the command exits 130 with no
run directory left (the signal came before training began) or exits 0 with a checkpoint to
resume (it came while training), and never prints a crash ("Fatal Python error", a traceback)
or dies of a signal. Without ``--delays`` the moments run every ``--every`` seconds from
``--start`` until one lands after the first step.

``--command=NAME`` (or ``all``): the stop contract of :mod:`dagmoe_jax.stopping` for the other
commands. Their inputs (a smoke run, a Hugging Face Mixtral and Llama folder, an imported run,
a text corpus) are made once in ``--fixtures`` (kept for the next sweep). The command runs once
to the end (its time T), then at the moments 0.35 s (the import window), 0.3 T, 0.55 T, 0.8 T
and T - 0.15 s (or ``--delays``): a moment passes when the command exits 130 with one line
"error: SIGINT received: ..." as the last of its output and nothing it writes left behind (no
output, no hidden sibling), or exits 0 with its output complete; never a crash, and never a
command's "done" line with exit 130.

Prints one line per moment and a summary; exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = ["--gin_file=train/smoke.gin", "--gin.RunConfig.tensorboard=False",
            "--gin.RunConfig.task_eval_examples=0", "--gin.RunConfig.steps=200"]
FINETUNE = ["--gin_file=finetune/smoke.gin", "--gin.RunConfig.tensorboard=False",
            f"--gin.DataConfig.source='instruct:{REPO / 'tests/fixtures/instruct_tiny.jsonl'}'",
            "--gin.RunConfig.epochs=0", "--gin.RunConfig.steps=200"]
CRASH_WORDS = ("Fatal Python error", "Traceback (most recent call last)", "Segmentation fault")


def _env() -> dict:
    """The environment of the commands: one CPU device, as on a user's machine (not a test
    process's simulated eight, which a checkpoint would then be saved on)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
            "PYTHONUNBUFFERED": "1", "XLA_FLAGS": " ".join(flags)}


def pretrained_source(root: Path) -> Path:
    """A 2-step smoke run to fine-tune from."""
    run_dir = root / "source"
    subprocess.run([sys.executable, str(REPO / "train.py"), *PRETRAIN, "--no_progress",
                    "--gin.RunConfig.steps=2", f"--run_dir={run_dir}"], check=True,
                   capture_output=True, env=_env(), cwd=REPO, timeout=600)
    return run_dir


def start(argv, run_dir: Path, log: Path) -> subprocess.Popen:
    """``train.py`` in a session of its own (its process group is the signal's target)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(REPO / "train.py"), *argv, "--no_progress",
                                 f"--run_dir={run_dir}"], stdout=out, stderr=subprocess.STDOUT,
                                env=_env(), cwd=REPO, start_new_session=True)


def verdict(code: int, output: str, run_dir: Path) -> dict:
    """What one moment's command did, and whether that is a clean end."""
    trained = "step 1: compiled" in output or "saved a checkpoint at step" in output
    checkpoint = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    crash = next((w for w in CRASH_WORDS if w in output), "")
    clean = not crash and ((code == 130 and not run_dir.exists())
                           or (code == 0 and checkpoint))
    return {"code": code, "run_dir_left": run_dir.exists(), "checkpoint": checkpoint,
            "trained": trained, "crash": crash, "clean": clean,
            "tail": output.strip().splitlines()[-1 if clean else -25:]}


def signal_moments(delays, parallel: int, launch, judge):
    """SIGINT to each launched command's process group ``delay`` seconds after its start,
    ``parallel`` at a time; yields (delay, verdict). ``launch(delay)`` -> (what it writes, its
    log, the process); ``judge(code, output, what it writes)`` -> the verdict."""
    pending, running = list(delays), []
    while pending or running:
        while pending and len(running) < parallel:
            delay = pending.pop(0)
            running.append([delay, *launch(delay), time.monotonic() + delay])
        time.sleep(0.02)
        for item in list(running):
            delay, target, log, proc, when = item
            if when is not None and time.monotonic() >= when and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                item[4] = None                                    # sent
            if proc.poll() is not None:
                running.remove(item)
                yield delay, judge(proc.returncode, log.read_text(), target)


def moments(argv, delays, root: Path, parallel: int):
    """Run train.py's moments ``delays`` (seconds), ``parallel`` at a time; yields (delay,
    verdict)."""
    def launch(delay):
        run_dir, log = root / f"run_{delay:g}", root / f"run_{delay:g}.log"
        return run_dir, log, start(argv, run_dir, log)
    return signal_moments(delays, parallel, launch, verdict)


# --- every other command -----------------------------------------------------------------------

# name: (the module ``python -m`` runs, its arguments from the fixtures and an output path,
# what a complete run leaves under that path (a glob pattern; None: it writes nothing; "": the
# path is a file), the line it prints when done ("": none))
COMMANDS = {
    "sample": ("dagmoe_jax.cli.sample",
               lambda f, out: [f"--run_dir={f / 'run'}", "--prompt=hello", "--max_new_tokens=48"],
               None, "--- sample 0 ---"),
    "export": ("dagmoe_jax.cli.export",
               lambda f, out: [f"--run_dir={f / 'imported'}", f"--out={out}"],
               "model.safetensors", "exported step"),
    "import": ("dagmoe_jax.cli.hf_import",
               lambda f, out: [f"--hf={f / 'mixtral'}", f"--run_dir={out}"],
               "config.json", "imported "),
    "analyze": ("dagmoe_jax.cli.analyze",
                lambda f, out: [f"--run_dir={f / 'run'}", f"--out={out}", "--batches=1"],
                "summary.json", "wrote "),
    "upcycle": ("dagmoe_jax.upcycle",
                lambda f, out: [f"--run_dir={out}", f"--dense={f / 'llama'}",
                                f"--source=text:{f / 'corpus.txt'}", f"--dense={f / 'llama'}",
                                f"--source=text:{f / 'corpus.txt'}", "--stats_batches=2",
                                "--steps=2"],
                "config.json", "wrote "),
    "topics": ("dagmoe_jax.families.doe.command",
               lambda f, out: ["--gin_file=train/doe_smoke.gin",
                               f"--gin.DataConfig.source='text:{f / 'corpus.txt'}'",
                               f"--out={out}", "--max_iter=2"],
               "topics.json", "saved to "),
    "harness": ("dagmoe_jax.harness",
                lambda f, out: [f"--run_dir={f / 'run'}", "--tasks=dagmoe_mc",
                                f"--include_path={REPO / 'tests' / 'harness_tasks'}",
                                "--limit=2", "--bootstrap_iters=0", "--mesh=none",
                                f"--output_path={out}"],
                "*/results_*.json", "results written to"),
    "compile": ("dagmoe_jax.compile",
                lambda f, out: ["--gin_file=train/smoke.gin", "--topology=v5p:2x2x1",
                                "--programs=train", f"--json={out}"],
                "", ""),
}


def make_fixtures(root: Path) -> Path:
    """The commands' inputs in ``root`` (made once, reused): a 2-step smoke run, a Hugging Face
    Mixtral folder (transformers' own, tests/fixtures) with a byte-level tokenizer, the run
    imported from it (an exportable MoE), a tiny Llama folder and a text corpus."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "run" / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "train.py"), *PRETRAIN, "--no_progress",
                        "--gin.RunConfig.steps=2", f"--run_dir={root / 'run'}"], check=True,
                       capture_output=True, env=_env(), cwd=REPO, timeout=600)
    if not (root / "corpus.txt").is_file():
        paragraphs = [" ".join(f"word{(i * 7 + j) % 50} topic{i % 4}" for j in range(40))
                      for i in range(80)]
        (root / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n")
    if not (root / "mixtral" / "tokenizer.json").is_file():
        subprocess.run([sys.executable, "-c", FOLDERS, str(root)], check=True,
                       capture_output=True, env=_env(), cwd=REPO, timeout=600)
    if not (root / "imported" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "dagmoe_jax.cli.hf_import",
                        f"--hf={root / 'mixtral'}", f"--run_dir={root / 'imported'}"],
                       check=True, capture_output=True, env=_env(), cwd=REPO, timeout=600)
    return root


# The Hugging Face folders, made in a child (the library's own writers): transformers' Mixtral
# from tests/fixtures with the byte-level tokenizer a run of byte tokens exports, and a tiny
# Llama exported from a random dense model.
FOLDERS = """if True:
    import shutil, sys
    from pathlib import Path
    from flax import nnx
    from dagmoe_jax.config import ModelConfig
    from dagmoe_jax.data import DataConfig
    from dagmoe_jax.hf.export import export_hf
    from dagmoe_jax.hf.tokenizer import export_tokenizer
    from dagmoe_jax.model import Transformer
    root = Path(sys.argv[1])
    byte = DataConfig(tokenizer="byte", seq_len=64)
    shutil.copytree(Path("tests/fixtures/hf_moe/mixtral"), root / "mixtral", dirs_exist_ok=True)
    export_tokenizer(byte, root / "mixtral")
    cfg = ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_seq_len=128).replace(block="dense")
    export_hf(Transformer(cfg, rngs=nnx.Rngs(0)), root / "llama")
    export_tokenizer(byte, root / "llama")
"""


def start_command(name: str, fixtures: Path, out: Path, log: Path) -> subprocess.Popen:
    module, argv, _, _ = COMMANDS[name]
    with open(log, "w") as sink:
        return subprocess.Popen([sys.executable, "-m", module, *argv(fixtures, out)],
                                stdout=sink, stderr=subprocess.STDOUT, env=_env(), cwd=REPO,
                                start_new_session=True)


def left_behind(out: Path) -> list:
    """What a stopped command left: its output, or a hidden sibling of it."""
    return sorted(p.name for p in out.parent.iterdir()
                  if p.name == out.name or p.name.startswith(f".{out.name}"))


def command_verdict(name: str, code: int, output: str, out: Path) -> dict:
    """One moment of command ``name`` by the stop contract (module docstring)."""
    _, _, written, done = COMMANDS[name]
    # a progress line ends with a carriage return: what follows it starts a line of its own
    lines = [line for line in output.replace("\r", "\n").splitlines() if line.strip()]
    crash = next((w for w in CRASH_WORDS if w in output), "")
    left = left_behind(out)
    if written is None:                                  # writes nothing
        complete = done in output
    elif written:                                        # a directory holding ``written``
        complete = done in output and any(out.glob(written))
    else:                                                # a file
        complete = done in output and out.is_file()
    stopped = (code == 130 and bool(lines) and lines[-1].startswith("error: SIGINT received: ")
               and sum(line.startswith("error:") for line in lines) == 1)
    said_done = bool(done) and done in output
    clean = not crash and ((stopped and not left and not said_done)
                           or (code == 0 and complete))
    return {"code": code, "left": left, "complete": complete, "crash": crash, "clean": clean,
            "tail": lines[-1 if clean else -25:]}


def command_moments(name: str, fixtures: Path, delays, root: Path, parallel: int):
    """Run command ``name``'s moments ``delays`` (seconds), ``parallel`` at a time; yields
    (delay, verdict)."""
    def launch(delay):
        work = root / f"{name}_{delay:g}"
        work.mkdir(parents=True, exist_ok=True)
        out, log = work / "out", root / f"{name}_{delay:g}.log"
        return out, log, start_command(name, fixtures, out, log)
    return signal_moments(delays, parallel, launch,
                          lambda code, output, out: command_verdict(name, code, output, out))


# Inside ``import jax`` (0.1-1 s in): the handlers are installed from the command's first line,
# after the interpreter's own start and ``import dagmoe_jax``'s configs (about 0.1 s, Python's
# own KeyboardInterrupt there).
IMPORT_WINDOW = 0.35


def sweep_command(name: str, fixtures: Path, root: Path, delays, parallel: int) -> list:
    """The moments of command ``name``: ``delays``, or from a run to the end (its time T)."""
    if not delays:
        began = time.monotonic()
        (_, first), = command_moments(name, fixtures, [3600.0], root / "whole", 1)
        took = time.monotonic() - began
        if not first["clean"]:
            return [(-1.0, first)]
        delays = [IMPORT_WINDOW] + [round(f * took, 2) for f in (0.3, 0.55, 0.8)] + \
            [round(max(took - 0.15, 0.2), 2)]
    return list(command_moments(name, fixtures, delays, root, parallel))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--finetune", action="store_true")
    parser.add_argument("--delays", default="", help="comma-separated seconds")
    parser.add_argument("--start", type=float, default=0.5)
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--json", default="", help="write the verdicts here")
    parser.add_argument("--keep", default="", help="run in this directory and keep each "
                        "moment's output (run_<seconds>.log) there")
    parser.add_argument("--command", default="train.py",
                        help=f"train.py, all, or one of: {', '.join(COMMANDS)}")
    parser.add_argument("--fixtures", default="", help="(--command) where the commands' "
                        "inputs are made once and kept")
    args = parser.parse_args(argv)
    if args.command != "train.py":
        return _sweep_commands(args)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        command = PRETRAIN
        if args.finetune:
            command = [*FINETUNE, f"--gin.RunConfig.init_from='{pretrained_source(root)}'"]
        results = []
        if args.delays:
            delays = [float(d) for d in args.delays.split(",")]
            results = list(moments(command, delays, root, args.parallel))
        else:                               # every --every seconds until one trained
            delay = args.start
            while not any(v["trained"] for _, v in results):
                results += list(moments(command, [delay], root, 1))
                delay += args.every
        for delay, v in sorted(results):
            print(f"SIGINT at {delay:5.1f} s: exit {v['code']}, "
                  f"{'checkpoint' if v['checkpoint'] else 'no checkpoint'}, run directory "
                  f"{'left' if v['run_dir_left'] else 'absent'}"
                  f"{', CRASH: ' + v['crash'] if v['crash'] else ''} -> "
                  f"{'clean' if v['clean'] else 'NOT CLEAN:'}", flush=True)
            if not v["clean"]:
                print("".join(f"    | {line}\n" for line in v["tail"]), end="")
    bad = [d for d, v in results if not v["clean"]]
    print(f"{len(results) - len(bad)} of {len(results)} moments ended cleanly"
          + (f"; not: {', '.join(f'{d:g} s' for d in sorted(bad))}" if bad else ""))
    if args.json:
        Path(args.json).write_text(json.dumps([{"delay": d, **v} for d, v in results]))
    return 1 if bad else 0


def _sweep_commands(args) -> int:
    names = list(COMMANDS) if args.command == "all" else args.command.split(",")
    unknown = [n for n in names if n not in COMMANDS]
    if unknown:
        print(f"error: unknown command {unknown[0]!r}: one of {', '.join(COMMANDS)}")
        return 2
    delays = [float(d) for d in args.delays.split(",")] if args.delays else []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        fixtures = make_fixtures(Path(args.fixtures) if args.fixtures else root / "fixtures")
        for name in names:
            for delay, v in sorted(sweep_command(name, fixtures, root, delays, args.parallel),
                                   key=lambda r: r[0]):
                results.append({"command": name, "delay": delay, **v})
                print(f"{name:8s} SIGINT at {delay:6.2f} s: exit {v['code']}"
                      f"{', left ' + ' '.join(v['left']) if v['left'] else ''}"
                      f"{', CRASH: ' + v['crash'] if v['crash'] else ''} -> "
                      f"{'clean' if v['clean'] else 'NOT CLEAN:'}"
                      f"{'' if not v['clean'] else '  | ' + (v['tail'] or [''])[-1][:90]}",
                      flush=True)
                if not v["clean"]:
                    print("".join(f"    | {line}\n" for line in v["tail"]), end="")
    bad = [r for r in results if not r["clean"]]
    print(f"{len(results) - len(bad)} of {len(results)} moments ended cleanly")
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
