"""Where one training step's time goes, instruction by instruction, from XLA's own profile.

It builds the training step of a model (default: MoE-s at vocabulary 256, batch 8 x 512, the
library's settled defaults), runs it under ``jax.profiler.trace`` and reads the executed HLO
instructions off the trace (XLA:CPU records every thunk it runs, with its instruction's name).
Each instruction is put in a category from the compiled HLO text (its opcode, its fusion's
kind, the custom call it makes, the parameters it reads):

=============  ===========================================================================
matmul         dot instructions and the XLA:CPU matmul fusions (YNNPACK / oneDNN)
attention      the fused C++ attention kernel (``dagmoe_causal_attention*``)
grouped mm     the C++ grouped matmul of dropless dispatch (``dagmoe_gmm*``, ``dagmoe_tgmm``)
optimizer      elementwise work on the optimizer state (AdamW's moments and update)
weight copy    slices, concatenations and copies of the parameters (stacked layer weights
               sliced per layer, SwiGLU's [W_gate | W_up])
data movement  other slices, concatenations, copies, transposes, gathers and scatters
elementwise    the remaining loop / input fusions: norms, activations, router softmax and
               top-k bookkeeping, the loss
other          everything else
=============  ===========================================================================

    python -m benchmarks.step_profile                      # MoE-s, vocab 256
    python -m benchmarks.step_profile --gin variants/dag_g128_l2.gin --top 30
    python -m benchmarks.step_profile --binding "ExpertConfig.dispatch = 'capacity'"

Times are wall time per step summed over instructions (XLA:CPU runs nearly all of them one after
another, so the sum is close to the step; the table prints both). Instructions are the compiled
program's, so the categories follow what XLA fused, not the Python code.

The trace inflates what it measures (its instructions sum to about 1.5x the untraced step, and
independent instructions overlap, each on fewer threads). ``--perf SECONDS`` measures the other
way: it runs untraced steps while ``perf record -a`` samples every CPU for SECONDS, and splits
the samples by the code they land in (:data:`PERF_GROUPS`): the C++ kernels, XLA's generated
loops (every fusion: elementwise, optimizer, copies), XLA's matmul libraries, the OS (idle
included) and the rest, as CPU seconds per step. It needs ``perf`` (Debian's ``linux-perf``) and
the right to sample the system (root, or ``kernel.perf_event_paranoid`` <= 0).

    python -m benchmarks.step_profile --perf 15             # MoE-s, ~1 min
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

import jax
import numpy as np

from dagmoe_jax.compile.hlo import attr, parse_module
from dagmoe_jax.run.allocator import allocator
from dagmoe_jax.run.gin import load_execution_config, load_model_config
from dagmoe_jax.model.settle import describe, settle
from benchmarks.scaling import trace_events  # the profiler's events, as scaling.py reads them
from benchmarks.step_throughput import time_fn, train_step

CATEGORIES = ("matmul", "attention", "grouped mm", "optimizer", "weight copy", "data movement",
              "elementwise", "other")
MOVES = ("slice", "concatenate", "copy", "transpose", "gather", "scatter", "dynamic-slice",
         "dynamic-update-slice", "pad", "reverse")

# perf's samples by where they land: (group, library pattern, symbol pattern), first match wins.
PERF_GROUPS = (
    ("grouped matmul kernel", r"^grouped_matmul-", ""),
    ("attention kernel", r"^causal_attention-", ""),
    ("DAG kernels", r"^dag_module-", ""),
    ("XLA generated loops (fusions)", r"^\[JIT\]", ""),
    ("XLA matmul libraries", r"^libjax_common", r"^(ynn::dot|Eigen::internal::(gebp|gemm))"),
    ("XLA runtime and other library code", r"^libjax_common", ""),
    ("idle", r"^\[kernel", r"(safe_halt|idle|mwait)"),
    ("OS kernel", r"^\[kernel", ""),
    ("libc (malloc, memcpy)", r"^libc[.-]", ""),
    ("Python", r"^libpython", ""),
)
_PERF_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+(?: tid \d+)?)\s+\[[.k]\]\s+(.*?)\s*$")


def parse_hlo(text: str) -> Tuple[Dict[str, dict], Dict[str, List[str]]]:
    """(instruction name -> {opcode, operands, calls, kind, target, computation},
    computation name -> opcodes of its instructions) from a compiled module's HLO text, as
    :func:`dagmoe_jax.compile.hlo.parse_module` reads it."""
    instructions, computations = {}, {}
    for computation, body in parse_module(text)[0].items():
        computations[computation] = [ins.op for ins in body]
        for ins in body:
            instructions[ins.name] = dict(
                opcode=ins.op, operands=ins.operands, computation=computation,
                calls=(attr(ins.attrs, "calls") or "").lstrip("%") or None,
                kind=attr(ins.attrs, "kind") or "",
                target=(attr(ins.attrs, "custom_call_target") or "").strip('"'))
    return instructions, computations


def _reads(instructions: Dict[str, dict], name: str, prefixes: Tuple[str, ...],
           depth: int = 4) -> bool:
    """Whether instruction ``name`` reads (through up to ``depth`` producers) an entry parameter
    whose name starts with one of ``prefixes`` (nnx names them after the state they hold)."""
    frontier, seen = [name], set()
    for _ in range(depth):
        following = []
        for n in frontier:
            for op in instructions.get(n, {}).get("operands", ()):
                if op.startswith(prefixes):
                    return True
                if op not in seen:
                    seen.add(op)
                    following.append(op)
        frontier = following
    return False


def categorize(name: str, instructions: Dict[str, dict],
               computations: Dict[str, List[str]]) -> str:
    """The category (:data:`CATEGORIES`) of executed instruction ``name``."""
    info = instructions.get(name)
    if info is None:
        return "other"
    opcode, target = info["opcode"], info["target"]
    inner = computations.get(info["calls"] or "", [])
    if opcode in ("custom-call",) or target:
        if "attention" in target:
            return "attention"
        if "gmm" in target:
            return "grouped mm"
        return "matmul" if "matmul" in target or "gemm" in target else "other"
    if opcode in ("dot", "convolution") or (opcode == "fusion" and info["kind"] == "kCustom") \
            or (opcode == "fusion" and "dot" in inner):
        return "matmul"
    moving = opcode in MOVES or (opcode == "fusion" and inner and all(
        op in MOVES or op in ("parameter", "bitcast", "broadcast", "constant", "tuple",
                              "get-tuple-element") for op in inner))
    if moving:
        reads_params = _reads(instructions, name, ("model_states", "param"), depth=3)
        return "weight copy" if reads_params else "data movement"
    if opcode == "fusion" and _reads(instructions, name, ("optimizer_states",), depth=2):
        return "optimizer"
    if opcode == "fusion":
        return "elementwise"
    return "other"


def instruction_seconds(events: List[dict],
                        module: str = "jit_step") -> Tuple[Dict[str, float], float]:
    """(instruction -> seconds per execution, span of an execution in seconds), averaged over
    the executions of ``module`` in ``events``."""
    runs = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if args.get("hlo_op") and args.get("hlo_module", module) == module:
            runs[args.get("run_id")].append(e)
    if not runs:
        raise RuntimeError(f"the trace has no instruction of {module}")
    per, spans = collections.defaultdict(float), []
    for evs in runs.values():
        spans.append((max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)) / 1e6)
        for e in evs:
            per[e["args"]["hlo_op"]] += e["dur"] / 1e6 / len(runs)
    return dict(per), float(np.mean(spans))


def perf_groups(report: str) -> Dict[str, float]:
    """{group: percent of samples} from ``perf report --sort dso,sym`` text; samples no group
    of :data:`PERF_GROUPS` takes count as 'other'."""
    out = collections.defaultdict(float)
    for line in report.splitlines():
        m = _PERF_LINE.match(line)
        if not m:
            continue
        share, dso, sym = float(m.group(1)), m.group(2), m.group(3)
        group = next((g for g, lib, pattern in PERF_GROUPS
                      if re.search(lib, dso) and re.search(pattern, sym)), "other")
        out[group] += share
    return dict(out)


def perf_step(cfg, execution, batch: int, seq: int, seconds: float):
    """(steps run, wall seconds, {group: percent}) of untraced steps sampled by ``perf record
    -a`` for ``seconds`` after three warm-up steps."""
    step, model, optimizer, data = train_step(cfg, execution, batch, seq)
    for _ in range(3):
        jax.block_until_ready(step(model, optimizer, data))
    with tempfile.TemporaryDirectory() as tmp:
        record = subprocess.Popen(["perf", "record", "-a", "-e", "cpu-clock", "-q", "-o",
                                   f"{tmp}/perf.data", "--", "sleep", str(seconds)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        start, steps = time.perf_counter(), 0
        while record.poll() is None:
            jax.block_until_ready(step(model, optimizer, data))
            steps += 1
        wall = time.perf_counter() - start
        if record.returncode != 0:
            raise RuntimeError(f"perf record failed: {record.stderr.read().strip()[:300]}")
        report = subprocess.run(["perf", "report", "-i", f"{tmp}/perf.data", "--stdio",
                                 "--no-children", "--sort", "dso,sym"],
                                capture_output=True, text=True, check=True).stdout
    return steps, wall, perf_groups(report)


def print_perf(steps: int, wall: float, groups: Dict[str, float]) -> None:
    cpus = os.cpu_count()  # perf -a samples every CPU
    per_step = wall / max(steps, 1)
    print(f"\n{steps} untraced steps in {wall:.1f} s ({per_step:.3f} s/step), sampled on all "
          f"{cpus} CPUs by perf: {cpus * per_step:.2f} CPU s a step\n")
    print("| where | CPU s/step | share |\n|---|---:|---:|")
    for group in [g for g, _, _ in PERF_GROUPS] + ["other"]:
        if group in groups:
            share = groups[group] / 100
            print(f"| {group} | {share * cpus * per_step:.3f} | {share:.1%} |")


def profile_step(cfg, execution, batch: int, seq: int, steps: int):
    """(step seconds, {instruction: seconds}, span, instructions, computations) of ``cfg``
    run as ``execution``."""
    step, model, optimizer, data = train_step(cfg, execution, batch, seq)
    run = lambda: jax.block_until_ready(step(model, optimizer, data))  # noqa: E731
    seconds = time_fn(run, steps)
    text = step.lower(model, optimizer, data).compile().as_text()
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(steps):
                run()
        per, span = instruction_seconds(trace_events(log_dir))
    instructions, computations = parse_hlo(text)
    return seconds, per, span, instructions, computations


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/s.gin", help="model-size gin file")
    p.add_argument("--gin", action="append", default=None,
                   help="variant / extra gin files (default: variants/moe.gin), repeatable")
    p.add_argument("--binding", action="append", default=[], help="extra gin binding, repeatable")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed and profiled steps")
    p.add_argument("--top", type=int, default=15, help="slowest instructions listed")
    p.add_argument("--perf", type=float, default=0, metavar="SECONDS",
                   help="instead of the trace: sample untraced steps with perf for SECONDS")
    args = p.parse_args(argv)
    if args.perf and shutil.which("perf") is None:
        print("step_profile.py: --perf needs the perf tool (Debian: apt install linux-perf)",
              file=sys.stderr)
        return 2
    files = [args.model, *(args.gin or ["variants/moe.gin"])]
    bindings = [*args.binding, f"ModelConfig.vocab_size = {args.vocab}"]
    cfg, execution = load_model_config(files, bindings), load_execution_config(files, bindings)
    settled = settle(cfg, execution, log=print)
    print(f"device: {jax.devices()[0].device_kind}  allocator: {allocator()}  model: "
          f"{describe(cfg, settled, execution)}\nbatch {args.batch} x {args.seq} tokens, "
          f"vocab {args.vocab}" + ("" if args.perf else f", {args.steps} steps"))
    if args.perf:
        try:
            print_perf(*perf_step(cfg, settled, args.batch, args.seq, args.perf))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"step_profile.py: {e}", file=sys.stderr)
            return 2
        return 0
    seconds, per, span, instructions, computations = profile_step(cfg, settled, args.batch,
                                                                  args.seq, args.steps)
    by_cat = collections.defaultdict(float)
    count = collections.Counter()
    for name, t in per.items():
        cat = categorize(name, instructions, computations)
        by_cat[cat] += t
        count[cat] += 1
    total = sum(per.values())
    print(f"\nstep {seconds:.3f} s (best of {args.steps}, untraced); traced: instructions sum "
          f"{total:.3f} s, span {span:.3f} s\n")
    print("| category | s/step | share | instructions |\n|---|---:|---:|---:|")
    for cat in CATEGORIES:
        if count[cat]:
            print(f"| {cat} | {by_cat[cat]:.3f} | {by_cat[cat] / total:.1%} | {count[cat]} |")
    targets = collections.defaultdict(lambda: [0.0, 0])
    for name, t in per.items():
        target = instructions.get(name, {}).get("target")
        if target:
            targets[target][0] += t
            targets[target][1] += 1
    if targets:
        print("\n| custom call | s/step | calls |\n|---|---:|---:|")
        for target, (t, n) in sorted(targets.items(), key=lambda kv: -kv[1][0]):
            print(f"| {target} | {t:.3f} | {n} |")
    print(f"\nslowest {args.top} instructions\n"
          f"| instruction | category | ms/step |\n|---|---|---:|")
    for name, t in sorted(per.items(), key=lambda kv: -kv[1])[:args.top]:
        target = instructions.get(name, {}).get("target")
        label = f"{name} ({target})" if target else name
        print(f"| {label} | {categorize(name, instructions, computations)} | {t * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    sys.exit(main())
