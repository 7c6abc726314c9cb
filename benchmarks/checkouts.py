"""The same training step timed in several checkouts and Python environments, side by side:
whether a slowdown came from a version pin, from our code, or from the machine.

Each named side is a checkout (a ``git worktree``) and the Python that runs it (its own
environment, e.g. the pins of that commit). Each round starts one fresh process per side,
``python -m benchmarks.peer_throughput --side ours`` run in that checkout (our MoE-s training
step: AdamW, float32, batch 8 x 512, best of ``--steps`` steps after a warm-up, glibc tuned),
in rotating order (round r starts at side r mod n, every second round reversed), so that the
machine's drift hits every side alike. Reported per side: the versions its child ran, the
median s/step over rounds with its range, and the median and range of the per-round ratio
to the first side (the ratio of two processes started minutes apart, which is what cancels
the machine's slow and fast phases).

    git worktree add /tmp/old 5c8b417
    python3.11 -m venv /tmp/venv-old && /tmp/venv-old/bin/pip install -r /tmp/old/requirements.txt
    python -m benchmarks.checkouts --side old=/tmp/old:/tmp/venv-old/bin/python \\
        --side old@today=/tmp/old --side main=. --rounds 6 --steps 5

A side without ``:PYTHON`` runs under this interpreter. Children run with
``JAX_PLATFORMS=cpu`` and without simulated devices.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

Side = Tuple[str, Path, str]           # name, checkout, python


def parse_side(text: str) -> Side:
    """``NAME=CHECKOUT[:PYTHON]`` -> (name, checkout, python)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--side {text!r}: expected NAME=CHECKOUT[:PYTHON]")
    checkout, _, python = rest.partition(":")
    path = Path(checkout).resolve()
    if not (path / "benchmarks" / "peer_throughput.py").exists():
        raise argparse.ArgumentTypeError(
            f"--side {text!r}: {path} has no benchmarks/peer_throughput.py (a checkout of this "
            "repository is needed)")
    return name, path, python or sys.executable


def order(round_: int, n: int) -> List[int]:
    """The sides' order in round ``round_``: rotated by the round, every second one reversed."""
    rotated = [(round_ + i) % n for i in range(n)]
    return rotated[::-1] if round_ % 2 else rotated


def child_env() -> Dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def python_version(python: str) -> str:
    return subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def run_side(side: Side, args, round_: int, out: Path) -> dict:
    name, checkout, python = side
    path = out / f"{name}-{round_}.json"
    cmd = [python, "-m", "benchmarks.peer_throughput", "--side", "ours", "--json", str(path),
           "--vocab", str(args.vocab), "--steps", str(args.steps), "--round", str(round_)]
    if args.tiny:
        cmd.append("--tiny")
    proc = subprocess.run(cmd, cwd=checkout, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0 or not path.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise SystemExit(f"side {name} ({checkout}, {python}) failed in round {round_} "
                         f"(exit {proc.returncode}): {' / '.join(tail)}")
    return json.loads(path.read_text())


def summary(names: Sequence[str], times: Dict[str, List[float]]) -> List[dict]:
    """Per side: rounds, median and range of s/step, and the median and range of the
    per-round ratio to the first side's time in the same round."""
    first = times[names[0]]
    rows = []
    for name in names:
        ratios = [t / f for t, f in zip(times[name], first)]
        rows.append(dict(side=name, rounds=len(times[name]),
                         median=statistics.median(times[name]), low=min(times[name]),
                         high=max(times[name]), ratio=statistics.median(ratios),
                         ratio_low=min(ratios), ratio_high=max(ratios)))
    return rows


def table(rows: List[dict], versions: Dict[str, str]) -> str:
    lines = ["| side | versions | rounds | median s/step | range | vs first side, per round |",
             "|---|---|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['side']} | {versions[r['side']]} | {r['rounds']} | "
                     f"{r['median']:.3f} | {r['low']:.3f}-{r['high']:.3f} | "
                     f"{r['ratio']:.3f}x ({r['ratio_low']:.3f}-{r['ratio_high']:.3f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", type=parse_side, action="append", required=True,
                   help="NAME=CHECKOUT[:PYTHON], repeatable (at least two)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="timed steps per process, best of")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="peer_throughput's tiny model (tests)")
    p.add_argument("--json", metavar="PATH", help="also write every child's record to PATH")
    args = p.parse_args(argv)
    if len(args.side) < 2 or len({s[0] for s in args.side}) != len(args.side):
        p.error("--side: at least two, with distinct names")
    names = [s[0] for s in args.side]
    times: Dict[str, List[float]] = {n: [] for n in names}
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i in order(r, len(args.side)):
                rec = run_side(args.side[i], args, r, Path(tmp))
                rec["side_name"] = names[i]
                records.append(rec)
                times[names[i]].append(rec["s_per_step"])
                print(f"round {r}: {names[i]} {rec['s_per_step']:.3f} s/step", flush=True)
    versions = {n: ", ".join([f"Python {python_version(s[2])}", *(
        f"{k} {v}" for k, v in next(rec["versions"] for rec in records
                                    if rec["side_name"] == n).items())])
        for n, s in zip(names, args.side)}
    print(table(summary(names, times), versions))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(records=records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
