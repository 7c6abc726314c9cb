"""Where one training step's device time goes, kernel by kernel, from a ``jax.profiler`` trace:
the events of the accelerator's streams (the processes the trace names ``/device:GPU:0`` and
the like; on CPU, where there are none, every event) summed by name over the traced steps, the largest first.

    python -m benchmarks.device_trace                       # MoE-l, vocabulary 128,256, 16 x 1024
    python -m benchmarks.device_trace --binding "ExpertConfig.dispatch = 'capacity'"
    python -m benchmarks.device_trace --model models/tiny.gin --vocab 256 --batch 2 --seq 64

On a GPU it runs the model as configs/gpu.gin does (bf16 compute). benchmarks/RESULTS.md's
H200 table quotes it for MoE-l with dropless and with capacity dispatch.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import sys
import tempfile

import jax

from benchmarks.step_throughput import load, train_step


def device_kernels(trace_file: str, steps: int) -> list:
    """[(name, ms per step, calls per step)] of the trace's device events, largest first."""
    with gzip.open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items()          # not libtpu's '/device:CUSTOM:...'
              if name.startswith("/device:") and not name.startswith("/device:CUSTOM")}
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (not device or e["pid"] in device):
            total[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    return [(name, us / 1e3 / steps, calls[name] // steps) for name, us in total.most_common()]


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
    kernels = device_kernels(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)[0],
                             args.steps)
    total = sum(ms for _, ms, _ in kernels)
    print(f"{jax.devices()[0].device_kind}: {' + '.join(gins)} {' '.join(args.binding)}, "
          f"{args.batch} x {args.seq} tokens: {total:.1f} ms of device events per step")
    for name, ms, n in kernels[:args.top]:
        print(f"{ms:9.2f} ms {n:5d}x {ms / total:6.1%}  {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
