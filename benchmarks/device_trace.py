"""Where one training step's device time goes, kernel by kernel, from a ``jax.profiler`` trace:
the events of the accelerator's streams (the processes the trace names ``/device:GPU:0`` and
the like) summed by name over the traced steps, the largest first, each with the HLO
instructions that launched it.

    python -m benchmarks.device_trace                       # MoE-l, vocabulary 128,256, 16 x 1024
    python -m benchmarks.device_trace --binding "ExpertConfig.dispatch = 'capacity'"
    python -m benchmarks.device_trace --model models/tiny.gin --vocab 256 --batch 2 --seq 64

On a GPU it runs the model as configs/gpu.gin does (bf16 compute). benchmarks/RESULTS.md's
H200 table quotes it for MoE-l with dropless and with capacity dispatch;
``benchmarks/accelerator.py`` reads the same tables (:func:`device_kernels`,
:func:`kernel_table`) off a trace of each variant it times.

What a trace's events carry (the ``*.trace.json.gz`` that ``jax.profiler.trace`` writes, read as
it is here): on a GPU, XLA:GPU's kernel launches are annotated ``Thunk:#hlo_op=...#`` inside
``XlaModule:#hlo_module=...,program_id=...#``, and the profiler copies each annotation's
``key=value`` pairs onto the device event of the kernel it launched, so a kernel's ``args`` hold
``hlo_op`` (the HLO instruction), ``hlo_module`` and ``program_id`` (beside the profiler's own
``correlation_id``, ``kernel_details`` and the like); a cuBLAS GEMM kernel is launched by many
dot instructions, a fusion's kernel by one. On CPU there is no device process: XLA:CPU records
each thunk it runs as a host event whose name is its instruction's and whose ``args`` hold
``hlo_op``, ``hlo_module``, ``run_id`` and ``device_ordinal`` (jax 0.11), so those are the
kernels there. Thunks run on several threads at once, so on CPU the kernels can sum to more than
the step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import sys
import tempfile
from typing import List, NamedTuple, Optional, Tuple

import jax

from benchmarks.step_throughput import load, train_step


DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Framework Ops",
                 "Framework Name Scope", "Source code", "Steps", "Launch Stats")
"""Lines of a device process that xprof derives from its kernels (an 'XLA Ops' event spans the
kernels of its op): not kernels, and summing them would count the kernels twice."""


class Kernel(NamedTuple):
    """One kernel's device time in a trace (every launch of its name summed)."""

    name: str
    ms_per_step: float
    calls_per_step: float
    hlo_ops: Tuple[str, ...]
    """The HLO instructions that launched it (an event's ``hlo_op``), most time first; empty
    where the trace names none."""


def device_kernels(trace_file: str, steps: int) -> Tuple[str, List[Kernel]]:
    """(which events were read, [:class:`Kernel`] largest first) of a ``*.trace.json.gz``
    holding ``steps`` steps. The events are the device processes' ('device'; ``/device:...``
    but not libtpu's ``/device:CUSTOM:...``, less :data:`DERIVED_LINES`); where the trace has no
    device process, the events that name an ``hlo_op`` ('hlo_op': XLA:CPU's thunks); where
    none does, every complete event ('all')."""
    with gzip.open(trace_file) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    meta = [e for e in events if e.get("ph") == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    lines = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta
             if e.get("name") == "thread_name"}
    device = {pid for pid, name in names.items()          # not libtpu's '/device:CUSTOM:...'
              if name.startswith("/device:") and not name.startswith("/device:CUSTOM")}
    complete = [e for e in events if e.get("ph") == "X"]
    if device:
        read = "device"
        chosen = [e for e in complete if e["pid"] in device
                  and lines.get((e["pid"], e.get("tid"))) not in DERIVED_LINES]
    elif any((e.get("args") or {}).get("hlo_op") for e in complete):
        read, chosen = "hlo_op", [e for e in complete if (e.get("args") or {}).get("hlo_op")]
    else:
        read, chosen = "all", complete
    total, calls = collections.Counter(), collections.Counter()
    ops = collections.defaultdict(collections.Counter)
    for e in chosen:
        total[e["name"]] += e.get("dur", 0)
        calls[e["name"]] += 1
        op = (e.get("args") or {}).get("hlo_op")
        if op:
            ops[e["name"]][op] += e.get("dur", 0)
    return read, [Kernel(name, us / 1e3 / steps, calls[name] / steps,
                         tuple(op for op, _ in ops[name].most_common()))
                  for name, us in total.most_common()]


def kernel_table(kernels: List[Kernel], step_s: Optional[float], top: int = 25) -> dict:
    """The ``top`` largest of ``kernels`` as JSON rows (name, HLO ops, ms and calls per step,
    share of the measured step ``step_s``; share None without one), their sum
    (``kernels_ms_per_step``) and the sum of all (``all_kernels_ms_per_step``), each also as a
    share of the step."""
    step_ms = step_s * 1e3 if step_s else None
    share = (lambda ms: ms / step_ms) if step_ms else (lambda ms: None)  # noqa: E731
    rows = [{"name": k.name, "hlo_ops": list(k.hlo_ops), "ms_per_step": k.ms_per_step,
             "calls_per_step": k.calls_per_step, "share": share(k.ms_per_step)}
            for k in kernels[:top]]
    listed, everything = sum(r["ms_per_step"] for r in rows), sum(k.ms_per_step for k in kernels)
    return {"kernels": rows, "kernel_count": len(kernels), "step_s": step_s,
            "kernels_ms_per_step": listed, "kernels_share": share(listed),
            "all_kernels_ms_per_step": everything, "all_kernels_share": share(everything)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/l.gin")
    p.add_argument("--variant", default="variants/moe.gin")
    p.add_argument("--binding", action="append", default=[])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2, help="traced steps (after 3 untraced)")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    gins = [args.model, args.variant] + (["gpu.gin"] if jax.default_backend() == "gpu" else [])
    cfg, execution = load(gins, [f"ModelConfig.vocab_size = {args.vocab}", *args.binding])
    step, model, optimizer, data = train_step(cfg, execution, args.batch, args.seq)
    for _ in range(3):
        jax.block_until_ready(step(model, optimizer, data))
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        for _ in range(args.steps):
            jax.block_until_ready(step(model, optimizer, data))
    _, kernels = device_kernels(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)[0],
                                args.steps)
    total = sum(k.ms_per_step for k in kernels)
    print(f"{jax.devices()[0].device_kind}: {' + '.join(gins)} {' '.join(args.binding)}, "
          f"{args.batch} x {args.seq} tokens: {total:.1f} ms of device events per step")
    for name, ms, n, ops in kernels[:args.top]:
        print(f"{ms:9.2f} ms {n:7.1f}x {ms / total:6.1%}  {name[:70]}  [{', '.join(ops[:3])}"
              f"{f' +{len(ops) - 3}' if len(ops) > 3 else ''}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
