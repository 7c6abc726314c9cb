"""Everything we want to know on an accelerator, in one command under 10 minutes.

GPU time is rare for this project: when a GPU (or TPU) is lent, run this first and put its
table in benchmarks/RESULTS.md with the device named.

    python -m benchmarks.accelerator                  # on the accelerator (~6-9 min on an H100)
    python -m benchmarks.accelerator --micro          # a CPU smoke run at a micro size (~1 min)
    python -m benchmarks.accelerator --budget_s 300   # stop starting new work after 300 s
    python -m benchmarks.accelerator --profile_steps 0   # no kernel tables (traces)

What it measures, in bf16 compute with float32 master weights (configs/gpu.gin) at the
Llama-3 vocabulary (128,256), batch x sequence tokens per step (default 16 x 1024):

0. on a GPU, ``benchmarks/gpu_check.py --quick`` first (its own process): the grouped-matmul
   kernels' numerics on the device against ``ragged_dot`` at a skewed routing, the DAG
   module's Triton kernels' against XLA's iteration, and the library's tiles timed beside
   XLA's (``python -m benchmarks.gpu_check`` alone also times other tiles);
1. the device and its datasheet bf16 peak, next to the bf16 matmul rate measured here;
2. for MoE-s, MoE-s + shared expert (d_r matched to the DAG module, the paper's parity
   baseline), DAG-MoE-s L 2 (d_g 128) and the l model as MoE, MoE + shared and DAG-MoE L 2
   (d_g 256), all dropless with ``ExecutionConfig`` 'auto' (the GPU grouped matmuls), then
   MoE-s and MoE-l with ``dispatch='capacity'`` (factor 1.25: drops tokens, the speed to
   beat), and DAG-MoE-s L 2 again with the DAG module's Triton kernels ('dag-s L2 triton',
   beside XLA's module that 'auto' settles to): the best step
   time of a full AdamW training step, tokens/s, model FLOP/s
   (:mod:`dagmoe_jax.model.accounting`), MFU against the datasheet peak and against the measured
   matmul rate, peak device memory, and beside each the step the library's roofline estimates
   from the same compiled program (:mod:`dagmoe_jax.compile.roofline`, the card's datasheet).
   Each variant runs in its own process, so its peak memory is its own; the budget cuts the
   last ones first;
3. where each variant's step goes, kernel by kernel: after its timed steps, in the same
   process, ``--profile_steps`` more steps (default 3; 0: none) run under ``jax.profiler``
   and :mod:`benchmarks.device_trace` reads the trace (the GPU's kernels; on CPU, XLA's
   thunks): the ``--top_kernels`` (25) kernels that took the most device time, each with the
   HLO instructions that launched it (``hlo_op``), its ms and calls per step and its share
   of the measured step, then their sum and the sum of all kernels against the step. Each
   variant's JSON row holds its table (``profile``: ``kernels``, ``kernels_ms_per_step``,
   ``all_kernels_ms_per_step``, ``step_s``) and the script prints them as Markdown tables for
   RESULTS.md, so that the few minutes of a lent GPU can be studied after it is gone. A
   profile that fails costs only its table (``profile``'s ``error`` says why), one that takes
   its process down too (the timing, printed before it, stays);
4. DAG-MoE L 2 / MoE + shared step ratios, s and l (the DAG-MoE paper: +4.49% at L 2 on an
   A100), and DAG-MoE-s L 2's step with the Triton kernels over its step with XLA's module;
5. with the time left, a short quality run: MoE, MoE + shared and DAG-MoE L 2 (d_g 128) of
   the s shape trained on the same tokens (600 steps x 32 x 512, 9.8M) of an offline corpus
   (this Python's standard-library docstrings, built where the script runs; nothing
   downloads) and scored on its held-out text, at a budget the project's CPU cannot reach;
   seed after seed (``--quality_seeds``, default 3) while the budget allows a whole one, with
   each variant's mean and spread over the seeds run.

Every number also goes to a JSON file (--json; default ``$OUT/accelerator.json`` where the
environment sets ``OUT``, as the lent machine does, else runs/accelerator/accelerator.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from dagmoe_jax.model.accounting import account
from dagmoe_jax.run.gin import load_execution_config, load_model_config
from benchmarks.device_trace import device_kernels, kernel_table
from benchmarks.step_throughput import matmul_rate, time_fn, train_step

# name -> (model gin, variant gin). The s variants at d_g 128 and the l ones at 256 are the
# paper's (DAG-MoE Appendix B.2).
VARIANTS = {
    "moe-s": ("models/s.gin", "variants/moe.gin"),
    "moe+shared-s": ("models/s.gin", "variants/moe_shared_g128_l2.gin"),
    "dag-s L2": ("models/s.gin", "variants/dag_g128_l2.gin"),
    "moe-l": ("models/l.gin", "variants/moe.gin"),
    "moe+shared-l": ("models/l.gin", "variants/moe_shared_g256_l2.gin"),
    "dag-l L2": ("models/l.gin", "variants/dag_g256_l2.gin"),
    "moe-s cap": ("models/s.gin", "variants/moe.gin"),
    "moe-l cap": ("models/l.gin", "variants/moe.gin"),
    "dag-s L2 triton": ("models/s.gin", "variants/dag_g128_l2.gin"),
}
CAPACITY = ("ExpertConfig.dispatch = 'capacity'", "ExpertConfig.capacity_factor = 1.25")
"""The bindings of the '... cap' variants: capacity dispatch, the speed dropless must match."""
TRITON_MODULE = ("ExecutionConfig.dag_module = 'triton'",)
"""The binding of the '... triton' variant: the DAG module's Triton kernels
(kernels/triton_dag_module.py) beside XLA's module, which 'auto' settles to on a GPU."""
RATIOS = (("dag-s L2", "moe+shared-s"), ("dag-l L2", "moe+shared-l"))
"""DAG-MoE L 2 over its parity baseline, MoE + a shared expert of the DAG module's size."""
DEVICE = "device"                             # the child that reads the device and its matmul rate
PAPER_RATIO_L2 = 1.0449                       # DAG-MoE summary: +4.49% wall clock at L 2, A100
QUALITY_VARIANTS = ("moe", "moe_shared", "dag_l2")
# The quality run's model on an accelerator: the s shape (Table 3) on bench/quality.gin's
# recipe, in bf16 compute; --micro keeps bench/quality.gin's CPU-sized model.
QUALITY_S = ("ModelConfig.d_model = 512", "ModelConfig.num_layers = 4",
             "ModelConfig.num_heads = 32", "ModelConfig.num_kv_heads = 8",
             "ModelConfig.max_seq_len = 512", "ExpertConfig.num_experts = 32",
             "ExpertConfig.expert_hidden = 256", "ModelConfig.compute_dtype = 'bfloat16'")

# Dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s, no sparsity), matched
# against jax's device_kind in this order (the first substring that matches wins).
PEAK_BF16 = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989.4e12), ("H200", 989.4e12),
    ("GH200", 989.4e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12),
    ("TPU v6", 918e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12),
    ("TPU v4", 275e12),
)
MICRO_BINDINGS = ("ModelConfig.d_model = 64", "ModelConfig.num_layers = 2",
                  "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2",
                  "ExpertConfig.num_experts = 8", "ExpertConfig.expert_hidden = 32",
                  "ExpertConfig.shared_hidden = 32", "AggregationConfig.dag_dim = 16")


def datasheet_peak(device_kind: str):
    """The datasheet dense bf16 FLOP/s of ``device_kind`` (None when it is not in the table)."""
    for needle, peak in PEAK_BF16:
        if needle.lower() in device_kind.lower():
            return peak
    return None


def variant_config(name: str, vocab: int, micro: bool):
    """(ModelConfig, ExecutionConfig) of variant ``name`` on gpu.gin."""
    model, variant = VARIANTS[name]
    files = [model, variant, "gpu.gin"]
    bindings = [f"ModelConfig.vocab_size = {vocab}", *(MICRO_BINDINGS if micro else ()),
                *(CAPACITY if name.endswith(" cap") else ()),
                *(TRITON_MODULE if name.endswith(" triton") else ())]
    return load_model_config(files, bindings), load_execution_config(files, bindings)


def peak_memory() -> int:
    """Peak bytes the default device has held in this process (0 where the backend keeps no
    statistics, as XLA:CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("peak_bytes_in_use", 0))


def estimated_step(step, model, optimizer, data) -> dict:
    """The roofline's step time of the compiled ``step`` on this device's card (None off the
    cards the compile tool knows), the grouped-matmul kernels it holds, and the card."""
    from dagmoe_jax.compile.chips import CHIPS
    from dagmoe_jax.compile.roofline import program_cost
    kind = jax.devices()[0].device_kind.lower()
    chip = next((c for name, c in CHIPS.items() if c.platform == "gpu" and name in kind), None)
    if chip is None or "pcie" in kind:
        return {"estimate_s": None}
    cost = program_cost(step.lower(model, optimizer, data).compile().as_text(), chip, 1)
    return {"estimate_s": cost.seconds, "card": chip.name, "kernels": cost.kernels}


def profile_kernels(run, steps: int, step_s: float, top: int = 25) -> dict:
    """The kernel table (:func:`benchmarks.device_trace.kernel_table`) of ``steps`` calls of
    ``run`` (one blocking step) under ``jax.profiler``, the trace in a temporary folder removed
    after, with ``steps`` and ``events`` (which events it sums:
    :func:`benchmarks.device_trace.device_kernels`); where profiling fails, ``{"error": why}``
    in one line."""
    folder = tempfile.mkdtemp(prefix="accelerator-trace-")
    try:
        with jax.profiler.trace(folder):
            for _ in range(steps):
                run()
        traces = sorted(glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True))
        if not traces:
            return {"error": "the profiler wrote no *.trace.json.gz"}
        read, kernels = device_kernels(traces[-1], steps)
    except Exception as e:  # noqa: BLE001 -- a failed profile must not cost the timed row
        return {"error": (f"{type(e).__name__}: {e}".splitlines() or ["?"])[0][:300]}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not kernels:
        return {"error": f"the trace holds no events to sum ({read} events read)"}
    return {"steps": steps, "events": read, **kernel_table(kernels, step_s, top)}


def measure_one(name: str, vocab: int, batch: int, seq: int, steps: int, micro: bool,
                profile_steps: int = 0, top_kernels: int = 25, timed=None) -> dict:
    """One variant's step time, throughput, peak memory and the roofline's estimate of the
    same step (run in a process of its own), then, with ``profile_steps``, the kernel table of
    that many more steps (:func:`profile_kernels`) as ``profile``, after the timing so that
    the profiler perturbs no timed step. ``timed``: called with the row before the profile
    runs (the child prints it, so that a profiler that takes the process down leaves the
    timing)."""
    cfg, execution = variant_config(name, vocab, micro)
    step, model, optimizer, data = train_step(cfg, execution, batch, seq)
    run = lambda: jax.block_until_ready(step(model, optimizer, data))  # noqa: E731
    t = time_fn(run, steps)
    acc = account(cfg, seq)
    tokens = batch * seq
    row = {"variant": name, "params": acc.total_params, "active_params": acc.total_active_params,
           "grouped_matmul": model.execution.grouped_matmul,
           "dag_module": model.execution.dag_module,
           "s_per_step": t, "tokens_per_s": tokens / t,
           "model_flops_per_s": acc.train_flops_per_token * tokens / t,
           "peak_memory_bytes": peak_memory(), **estimated_step(step, model, optimizer, data)}
    if not profile_steps:
        return row
    if timed is not None:
        timed(row)
    return {**row, "profile": profile_kernels(run, profile_steps, t, top_kernels)}


def device_info() -> dict:
    """The default device and its measured bf16 matmul rate (run in a process of its own)."""
    device = jax.devices()[0]
    n = 1024 if device.platform == "cpu" else 8192
    return {"variant": DEVICE, "device": device.device_kind, "platform": device.platform,
            "device_count": jax.device_count(), "matmul_n": n,
            "measured_bf16_matmul_flops": matmul_rate(n, dtype=jnp.bfloat16)}


def error_line(stderr: str) -> str:
    """The line of a child's ``stderr`` that says what went wrong: the exception's own line,
    not JAX's "removed its internal frames" note after it (else the last line)."""
    lines = stderr.strip().splitlines() or ["no output"]
    return next((line for line in reversed(lines) if "Error" in line.split(":")[0]), lines[-1])


def run_one_in_subprocess(name: str, args) -> dict:
    """``measure_one`` (or ``device_info`` for DEVICE) in a child process. The parent never
    opens the accelerator before its children are done: a GPU process preallocates most of the
    device's memory when its backend starts, so a parent holding the backend leaves its
    children too little (on an H200 every variant ran out of memory). A child that fails after
    printing its timed row (in the profile) gives that row, with why it has no kernel table."""
    cmd = [sys.executable, "-m", "benchmarks.accelerator", "--one", name, "--vocab",
           str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq), "--steps",
           str(args.steps), "--profile_steps", str(args.profile_steps), "--top_kernels",
           str(args.top_kernels)] + (["--micro"] if args.micro else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"variant": name, "error": error_line(out.stderr)}
    row = json.loads(lines[-1])
    if not out.returncode:
        return row
    if name != DEVICE and args.profile_steps and "profile" not in row:
        return {**row, "profile": {"error": f"the profiled steps ended the process (exit "
                                            f"{out.returncode}): {error_line(out.stderr)}"}}
    return {"variant": name, "error": error_line(out.stderr)}


def throughput_table(rows, peak, measured) -> str:
    head = (f"{'variant':<14}{'params':>15}{'s/step':>9}{'tokens/s':>12}{'TFLOP/s':>9}"
            f"{'MFU':>8}{'of matmul':>11}{'peak mem':>11}{'estimate':>10}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<14}  failed: {r['error']}")
            continue
        fps = r["model_flops_per_s"]
        mfu = f"{fps / peak:.1%}" if peak else "-"
        mem = f"{r['peak_memory_bytes'] / 2**30:.1f} GiB" if r["peak_memory_bytes"] else "-"
        estimate = f"{r['estimate_s']:.3f}" if r.get("estimate_s") else "-"
        lines.append(f"{r['variant']:<14}{r['params']:>15,}{r['s_per_step']:>9.3f}"
                     f"{r['tokens_per_s']:>12,.0f}{fps / 1e12:>9.1f}{mfu:>8}"
                     f"{fps / measured:>10.1%}{mem:>11}{estimate:>10}")
    return "\n".join(lines)


def profiled(row) -> str:
    """What ``row``'s profile found, for the line that reports the variant ('' unprofiled)."""
    profile = row.get("profile")
    if profile is None:
        return ""
    if "error" in profile:
        return f"; no kernel table ({profile['error']})"
    return (f"; {profile['all_kernels_ms_per_step']:.3f} ms of {profile['kernel_count']} "
            f"kernels a step ({profile['events']} events)")


EVENTS = {"device": "the device's kernels", "hlo_op": "XLA's instructions, no device traced",
          "all": "every event: no device traced, no instruction named"}
"""What the events a kernel table sums are (:func:`benchmarks.device_trace.device_kernels`)."""


def _cell(text: str, width: int = 60) -> str:
    """``text`` for a Markdown table cell: at most ``width`` characters, no '|'."""
    text = text if len(text) <= width else text[:width - 3] + "..."
    return text.replace("|", "\\|")


def kernel_table_markdown(rows, ops: int = 3) -> str:
    """Each profiled row's kernel table (``row["profile"]``, :func:`measure_one`) as Markdown
    for RESULTS.md: a line per variant with its step and the table's and all kernels' sums
    against it, then the kernels (name, the first ``ops`` HLO instructions that launched it,
    ms and calls per step, share of the step); a profile that failed is its line with why.
    '' where no row was profiled."""
    parts = []
    for r in rows:
        profile = r.get("profile")
        if profile is None or "error" in r:
            continue
        if "error" in profile:
            parts.append(f"**{r['variant']}**: no kernel table ({profile['error']})")
            continue
        share = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
        step = f"{profile['step_s'] * 1e3:.3f} ms" if profile["step_s"] else "not measured"
        listed, everything = profile["kernels_ms_per_step"], profile["all_kernels_ms_per_step"]
        lines = [f"**{r['variant']}** ({profile['steps']} steps traced; "
                 f"{EVENTS.get(profile['events'], profile['events'])}): step {step}; the "
                 f"{len(profile['kernels'])} largest of {profile['kernel_count']} kernels "
                 f"{listed:.3f} ms ({share(profile['kernels_share'])} of the step), all "
                 f"kernels {everything:.3f} ms ({share(profile['all_kernels_share'])})", "",
                 "| kernel | HLO ops | ms/step | calls/step | share of step |",
                 "|---|---|---:|---:|---:|"]
        for k in profile["kernels"]:
            more = f" +{len(k['hlo_ops']) - ops}" if len(k["hlo_ops"]) > ops else ""
            hlo = ", ".join(k["hlo_ops"][:ops]) + more or "-"
            lines.append(f"| `{_cell(k['name'])}` | {_cell(hlo, 80)} | {k['ms_per_step']:.3f} | "
                         f"{k['calls_per_step']:g} | {share(k['share'])} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def quality_run(args, deadline: float, out_dir: Path) -> dict:
    """MoE, MoE + shared and DAG-MoE L 2 on the offline standard-library corpus, seed after
    seed (every variant of seed 0, then of seed 1, ... up to ``--quality_seeds``): a seed
    starts only when the one before took less than the time left before ``deadline``
    (``time.monotonic()``), so the table holds whole seeds; its summary prints each variant's
    mean and spread over the seeds run."""
    from benchmarks.experiments.corpus import build_stdlib_corpus, corpus_sources
    from benchmarks.experiments.quality import (PAPER_SOURCE, QualityBudget, format_report,
                                                summarize, train_and_evaluate)

    source, eval_source = corpus_sources(build_stdlib_corpus(out_dir / "corpus"))
    budget = QualityBudget(source=source, eval_source=eval_source, variants=QUALITY_VARIANTS,
                           seeds=tuple(range(args.quality_seeds)),
                           steps=20 if args.micro else args.quality_steps,
                           batch_size=4 if args.micro else 32,
                           seq_len=64 if args.micro else 512,
                           eval_batches=2 if args.micro else 32,
                           dag_dim=32 if args.micro else 128,
                           bindings=() if args.micro else QUALITY_S)
    runs, seed_seconds = [], 0.0
    for seed in budget.seeds:
        if time.monotonic() + seed_seconds > deadline:
            print(f"  seed {seed} and after: skipped (--budget_s would be passed)")
            break
        tick = time.monotonic()
        for variant in budget.variants:
            runs.append(train_and_evaluate(budget, variant, seed,
                                           out_dir / "runs" / variant / f"seed{seed}",
                                           log=lambda message: print(f"  {message}",
                                                                     flush=True)))
        seed_seconds = time.monotonic() - tick
    results = {"budget": dataclasses.asdict(budget), "tokens_per_run": budget.tokens_per_run,
               "seeds_run": len({r["seed"] for r in runs}), "runs": runs,
               "summary": summarize(runs) if runs else {}}
    if runs:
        print(format_report({**results, "paper_source": PAPER_SOURCE}))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro", action="store_true",
                   help="micro models and batches: a CPU check that the script works")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 128256; "
                   "micro 512)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (default 16; micro 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default 1024; "
                   "micro 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant, best of "
                   "(default 5; micro 2)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--budget_s", type=float, default=540.0,
                   help="no new work starts after this many seconds (default 540: the device "
                        "tool's 10-minute command limit, less a margin)")
    p.add_argument("--quality_steps", type=int, default=600,
                   help="training steps per variant of the quality run (0: none)")
    p.add_argument("--quality_seeds", type=int, default=3,
                   help="seeds of the quality run, each run whole while the budget allows "
                        "(default 3)")
    p.add_argument("--profile_steps", type=int, default=3,
                   help="steps traced by jax.profiler after each variant's timed steps, for "
                        "its kernel table (default 3; 0: no trace)")
    p.add_argument("--top_kernels", type=int, default=25,
                   help="kernels in each variant's table, the most device time first "
                        "(default 25)")
    p.add_argument("--json", default=None, help="where the JSON goes")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)   # a child process
    args = p.parse_args(argv)
    micro = dict(vocab=512, batch=2, seq=32, steps=2)
    full = dict(vocab=128256, batch=16, seq=1024, steps=5)
    for key, value in (micro if args.micro else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.one:
        print(json.dumps(device_info() if args.one == DEVICE else
                         measure_one(args.one, args.vocab, args.batch, args.seq, args.steps,
                                     args.micro, args.profile_steps, args.top_kernels,
                                     timed=lambda row: print(json.dumps(row), flush=True))))
        return 0

    start = time.monotonic()
    info = run_one_in_subprocess(DEVICE, args)
    if "error" not in info and info["platform"] == "gpu":
        print("GPU kernels first (benchmarks/gpu_check.py):", flush=True)
        check = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--quick"],
                               check=False)
        if check.returncode:
            print(f"  gpu_check.py exited {check.returncode}: the table below uses kernels "
                  f"it did not pass", flush=True)
    if "error" in info:
        print(f"the device could not be read: {info['error']}", file=sys.stderr)
        return 2
    json_path = Path(args.json or (Path(os.environ["OUT"]) / "accelerator.json"
                                   if os.environ.get("OUT") else
                                   "runs/accelerator/accelerator.json"))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    peak = datasheet_peak(info["device"])
    measured, n = info["measured_bf16_matmul_flops"], info["matmul_n"]
    report = {"device": info["device"], "platform": info["platform"],
              "device_count": info["device_count"], "datasheet_bf16_flops": peak,
              "measured_bf16_matmul_flops": measured, "vocab": args.vocab,
              "batch": args.batch, "seq": args.seq, "steps": args.steps, "variants": []}
    print(f"device: {info['device']} ({info['platform']}) x{info['device_count']}; "
          f"bf16 datasheet peak {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown'}, "
          f"{n}^3 bf16 matmul measured {measured / 1e12:.2f} TFLOP/s")
    print(f"vocabulary {args.vocab}, {args.batch} x {args.seq} tokens per step, best of "
          f"{args.steps} timed steps; bf16 compute, float32 master weights (gpu.gin)\n",
          flush=True)
    for name in args.variants:
        if time.monotonic() - start > args.budget_s:
            print(f"  {name}: skipped (--budget_s {args.budget_s:.0f} s reached)")
            continue
        row = run_one_in_subprocess(name, args)
        report["variants"].append(row)
        print(f"  measured {name}: " + (f"{row['s_per_step']:.3f} s/step" if "error" not in row
                                        else f"failed ({row['error']})") + profiled(row),
              flush=True)
        json_path.write_text(json.dumps(report, indent=2))
    print("\n" + throughput_table(report["variants"], peak, measured))
    by_name = {r["variant"]: r for r in report["variants"] if "error" not in r}
    print()
    for dag_name, shared_name in RATIOS:
        if dag_name in by_name and shared_name in by_name:
            ratio = by_name[dag_name]["s_per_step"] / by_name[shared_name]["s_per_step"]
            report.setdefault("dag_over_shared_step_ratio", {})[dag_name] = ratio
            print(f"{dag_name} / {shared_name} step time: {ratio:.4f}x "
                  f"(the paper: {PAPER_RATIO_L2:.4f}x at L 2 on an A100)")
    kernels, xla = by_name.get("dag-s L2 triton"), by_name.get("dag-s L2")
    if kernels and xla and kernels["dag_module"] != xla["dag_module"]:
        ratio = kernels["s_per_step"] / xla["s_per_step"]
        report["dag_module_step_ratio"] = ratio
        print(f"dag-s L2 with the DAG module {kernels['dag_module']!r} / with "
              f"{xla['dag_module']!r}: {ratio:.4f}x step time")
    tables = kernel_table_markdown(report["variants"])
    if tables:
        print(f"\nKernels of one step, the most device time first (jax.profiler, "
              f"benchmarks/device_trace.py):\n\n{tables}")
    left = args.budget_s - (time.monotonic() - start)
    if args.quality_steps and left > 30:
        print(f"\nquality run ({left:.0f} s left): {', '.join(QUALITY_VARIANTS)}, up to "
              f"{args.quality_seeds} seeds", flush=True)
        report["quality"] = quality_run(args, start + args.budget_s,
                                        json_path.parent / "accelerator_runs")
    json_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {json_path} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
