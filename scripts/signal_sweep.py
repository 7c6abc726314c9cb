"""Ctrl-C at every moment of a run's start-up: does ``train.py`` always end cleanly?

    python scripts/signal_sweep.py                          # pre-training, every 0.5 s until it trains
    python scripts/signal_sweep.py --finetune --every 1     # fine-tuning from a 2-step run
    python scripts/signal_sweep.py --delays 3,6,9 --parallel 3 --json out.json

Each moment starts the smoke run (``configs/train/smoke.gin``; with ``--finetune``,
``configs/finetune/smoke.gin`` from a 2-step smoke run made first) in a fresh run directory
and a session of its own, and sends SIGINT to its whole process group after that many seconds,
as Ctrl-C in a terminal does. A moment passes when the command exits 130 with no run directory
left (the signal came before training began) or exits 0 with a checkpoint to resume (it came
while training), and never prints a crash ("Fatal Python error", a traceback) or dies of a
signal. Without ``--delays`` the moments run every ``--every`` seconds from ``--start`` until
one lands after the first step. Prints one line per moment and a summary; exit 1 if any failed.
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
    return {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
            "PYTHONUNBUFFERED": "1"}


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


def moments(argv, delays, root: Path, parallel: int):
    """Run the moments ``delays`` (seconds), ``parallel`` at a time; yields (delay, verdict)."""
    pending, running = list(delays), []
    while pending or running:
        while pending and len(running) < parallel:
            delay = pending.pop(0)
            run_dir, log = root / f"run_{delay:g}", root / f"run_{delay:g}.log"
            running.append([delay, run_dir, log, start(argv, run_dir, log),
                            time.monotonic() + delay])
        time.sleep(0.05)
        for item in list(running):
            delay, run_dir, log, proc, when = item
            if when is not None and time.monotonic() >= when and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                item[4] = None                                    # sent
            if proc.poll() is not None:
                running.remove(item)
                yield delay, verdict(proc.returncode, log.read_text(), run_dir)


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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
