"""Whether two checkouts compile the same training step: the evidence that a refactor left
speed unchanged, stronger than timing both (on a shared machine timings of one program vary by
5 %).

For each variant it compiles the AdamW training step of ``benchmarks/step_throughput.py``
(the s model at vocab 256, batch 8 x 512) in each checkout, each in its own process, and
compares the optimised HLO with the debug information (source files and lines, op names)
left out:

    git worktree add /tmp/before <commit>
    python -m benchmarks.same_program /tmp/before                  # this checkout vs /tmp/before
    python -m benchmarks.same_program /tmp/before --variants moe "dag L2" coe c2 g128

Exit status 0 when every variant's program is the same, 1 otherwise (the first differing
lines are printed).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

# Run inside each checkout (its working directory, first on the child's path): {variant:
# optimised HLO text without debug information}.
PROBE = r"""
import inspect, json, re, sys
from benchmarks.step_throughput import VARIANTS, train_step
from dagmoe_jax.run.gin import load_model_config
out = {}
for name in json.loads(sys.argv[2]):
    cfg = load_model_config(["models/s.gin", VARIANTS[name].format(g=128)],
                            ["ModelConfig.vocab_size = 256"])
    # train_step takes the execution config (None: every choice 'auto') since it left the
    # ModelConfig; a checkout from before then takes the ModelConfig alone.
    run = (cfg, None) if "execution" in inspect.signature(train_step).parameters else (cfg,)
    step, model, optimizer, data = train_step(*run, 8, 512)
    text = step.lower(model, optimizer, data).compile().as_text()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)                 # op names, source lines
    text = re.sub(r"^HloModule [^,]*", "HloModule", text, flags=re.M)
    text = "\n".join(line for line in text.splitlines()  # debug tables (files, frames)
                     if not re.match(r"^\d+ [{\"]", line))
    out[name] = text.replace(sys.argv[1], "<checkout>")
print(json.dumps(out))
"""


def programs(checkout: Path, variants) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", PROBE, str(checkout), json.dumps(variants)],
                            capture_output=True, text=True, env=env, check=False, cwd=checkout)
    if result.returncode:
        sys.exit(f"error: compiling in {checkout} failed: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", type=Path, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--variants", nargs="+", default=["moe", "dag L2"],
                   help="variants of benchmarks/step_throughput.py")
    args = p.parse_args(argv)
    mine, theirs = programs(HERE, args.variants), programs(args.other.resolve(), args.variants)
    same = True
    for name in args.variants:
        a, b = theirs[name].splitlines(), mine[name].splitlines()
        diff = list(difflib.unified_diff(a, b, str(args.other), str(HERE), n=0, lineterm=""))
        print(f"{name:<14} {len(b):>6} HLO lines: {'same program' if not diff else 'DIFFERENT'}")
        if diff:
            same = False
            print("\n".join(diff[:12]))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
