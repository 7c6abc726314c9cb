"""Training-step time on 1, 2, 4 and 8 devices for each parallel layout, side by side in one run.

For every device count and every mesh layout that fits it (dp N; ep N; dp 2 x ep N/2;
fsdp N/4 x ep 2 x tp 2) it builds the model and its AdamW optimizer sharded over the mesh
(``dagmoe_jax.run.state.build``, the optimizer of ``make_optimizer``) and compiles the jitted
training step (forward + backward + update). Then it times all layouts in round-robin rounds
(``--rounds`` of ``--steps`` steps; s/step is the best of them all, so a burst of load on a
shared machine hits the layouts alike) and reports tokens/s, the speed-up over one device,
the CPU cores the process kept busy, and the share of the step spent in collectives
(all-to-all, all-gather, reduce-scatter, all-reduce, collective-permute).

How the collective share is measured: two more steps per layout run under
``jax.profiler.trace(..., create_perfetto_trace=True)``. XLA:CPU records every HLO instruction
it executes as a trace event carrying the instruction's name (``hlo_op``), the device and the
execution (``run_id``); the compiled HLO text of the step maps each name to its opcode and its
result bytes. Per device and step, share = (union of the collective instructions' intervals) /
(the device's span from its first to its last instruction), then averaged over devices and
steps. A collective's time includes waiting at its rendezvous for the other devices to arrive
(the ``Rendezvous`` events nested in it), reported separately as "waiting". A second table
breaks the collectives down by kind: share of the step, instructions executed per step and
device (loops unrolled, as executed) and the megabytes they return.

Without accelerators the devices are simulated (``--xla_force_host_platform_device_count``, set
here before JAX starts unless XLA_FLAGS already sets it) and all of them share this machine's
cores: N devices add no compute, and a device that reaches a collective waits while the cores
run the other devices' work. The table measures what the parallel program costs (partitioning
and communication overheads), not how the model scales on real devices.

    python -m benchmarks.scaling              # 10 layouts (2-core CPU: about 4 minutes)
    python -m benchmarks.scaling --quick      # 1 and 8 devices, batch 8 x 128 (about 1.5 minutes)
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):     # before JAX starts its backend
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_DEVICE_FLAG}=8").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Callable, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dagmoe_jax.compile.hlo import parse_instruction, shape_bytes  # noqa: E402
from dagmoe_jax.run.gin import load_configs  # noqa: E402
from dagmoe_jax.parallel import MeshConfig, activate, make_mesh  # noqa: E402
from dagmoe_jax.run import build, device_batch  # noqa: E402
from dagmoe_jax.train.step import make_train_step  # noqa: E402
# best of N blocking calls after a warm-up
from benchmarks.step_throughput import time_fn  # noqa: E402


COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
PROFILED_STEPS = 2


# --------------------------------------------------------------------------------------------
# layouts


def layouts(n: int) -> List[Tuple[str, MeshConfig]]:
    """The mesh layouts benchmarked on ``n`` devices, as (name, MeshConfig)."""
    if n == 1:
        return [("1 device", MeshConfig(data=1))]
    out = [(f"dp {n}", MeshConfig(data=n)), (f"ep {n}", MeshConfig(data=1, expert=n))]
    if n >= 4 and n % 2 == 0:
        out.append((f"dp 2 x ep {n // 2}", MeshConfig(data=2, expert=n // 2)))
    if n >= 8 and n % 4 == 0:
        out.append((f"fsdp {n // 4} x ep 2 x tp 2",
                    MeshConfig(data=1, fsdp=n // 4, expert=2, tensor=2)))
    return out


def misfit(model_cfg, mesh_cfg: MeshConfig, batch: int) -> Optional[str]:
    """Why ``mesh_cfg`` cannot run this model and batch (None if it can)."""
    tok = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.expert
    checks = ((batch, tok, "batch rows"),
              (model_cfg.block.experts.num_experts, mesh_cfg.expert, "experts"),
              (model_cfg.num_heads, mesh_cfg.tensor, "heads"),
              (model_cfg.num_kv_heads, mesh_cfg.tensor, "kv heads"),
              (model_cfg.block.experts.expert_hidden, mesh_cfg.tensor, "expert hidden"),
              (model_cfg.vocab_size, mesh_cfg.tensor, "vocab"),
              (model_cfg.d_model, mesh_cfg.fsdp, "d_model"))
    for size, shards, what in checks:
        if size % shards:
            return f"{what} {size} not divisible by {shards}"
    return None


# --------------------------------------------------------------------------------------------
# compiled HLO text and the profiler trace

def hlo_instructions(hlo_text: str) -> Dict[str, Tuple[str, int]]:
    """Instruction name -> (opcode, result bytes) for every instruction in an HLO module's text
    (``compiled.as_text()``), read by :mod:`dagmoe_jax.compile.hlo`; a tuple result counts all
    its elements."""
    lines = (parse_instruction(line) for line in hlo_text.splitlines())
    return {ins.name: (ins.op, int(shape_bytes(ins.shape))) for ins in lines if ins is not None}


def collective_kind(opcode: str) -> Optional[str]:
    """The collective an opcode is ('all-gather' for all-gather, all-gather-start, ...), or None."""
    for kind in COLLECTIVES:
        if opcode == kind or opcode.startswith(kind + "-"):
            return kind
    return None


def _union(intervals: Sequence[Tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps and nesting counted once)."""
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclasses.dataclass
class Profile:
    """Collective time in the profiled steps, per step and device (means over both)."""

    share: float                      # in collective instructions / the device's step span
    wait_share: float                 # of which waiting at a rendezvous for the other devices
    by_kind: Dict[str, float]         # kind -> share of the step span
    count: Dict[str, float]           # kind -> instructions executed
    nbytes: Dict[str, float]          # kind -> bytes those instructions return


def trace_events(log_dir: str) -> List[dict]:
    """The complete ('X') events of the newest ``perfetto_trace.json.gz`` under ``log_dir``
    (written by ``jax.profiler.trace(..., create_perfetto_trace=True)``)."""
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    return [e for e in (data["traceEvents"] if isinstance(data, dict) else data)
            if e.get("ph") == "X"]


def read_trace(log_dir: str, instructions: Dict[str, Tuple[str, int]]) -> Profile:
    """Collective shares from the ``perfetto_trace.json.gz`` that ``jax.profiler.trace`` wrote
    to ``log_dir`` while the program whose :func:`hlo_instructions` are given ran.

    XLA:CPU records each executed instruction (thunk) as an event whose ``args`` carry
    ``hlo_op`` (the instruction name), ``device_ordinal`` and ``run_id`` (one execution of the
    program on one device). A collective's ``Rendezvous`` events nest inside it on the same
    thread: the time spent waiting for the other participants to arrive."""
    events = trace_events(log_dir)
    rendezvous = collections.defaultdict(list)   # thread -> [(start, end)]
    runs = collections.defaultdict(list)         # (run_id, device) -> [(start, end, name, thread)]
    for e in events:
        args = e.get("args") or {}
        if e["name"] == "Rendezvous":
            rendezvous[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
        elif args.get("hlo_op") in instructions:
            runs[(args.get("run_id"), args.get("device_ordinal"))].append(
                (e["ts"], e["ts"] + e["dur"], args["hlo_op"], e["tid"]))
    if not runs:
        raise RuntimeError("the trace has no events naming the step's HLO instructions")
    shares, wait_shares = [], []
    by_kind, count, nbytes = (collections.defaultdict(float) for _ in range(3))
    for ops in runs.values():
        start, end = min(o[0] for o in ops), max(o[1] for o in ops)
        span = max(end - start, 1e-9)
        coll = [(a, b, collective_kind(instructions[name][0]), instructions[name][1], tid)
                for a, b, name, tid in ops if collective_kind(instructions[name][0])]
        shares.append(_union([(a, b) for a, b, *_ in coll]) / span)
        waits = [(max(a, ra), min(b, rb)) for a, b, _, _, tid in coll
                 for ra, rb in rendezvous.get(tid, ()) if ra < b and rb > a]
        wait_shares.append(_union(waits) / span)
        for kind in COLLECTIVES:
            by_kind[kind] += _union([(a, b) for a, b, k, *_ in coll if k == kind]) / span
        for _, _, kind, size, _ in coll:
            count[kind] += 1
            nbytes[kind] += size
    n = len(runs)
    return Profile(share=float(np.mean(shares)), wait_share=float(np.mean(wait_shares)),
                   by_kind={k: v / n for k, v in by_kind.items()},
                   count={k: v / n for k, v in count.items()},
                   nbytes={k: v / n for k, v in nbytes.items()})


def profile_collectives(run_step: Callable[[], None], hlo_text: str,
                        steps: int = PROFILED_STEPS) -> Profile:
    """Run ``run_step()`` (which must block) ``steps`` times under ``jax.profiler.trace`` and
    read the collective shares of the program ``hlo_text`` off the trace."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(steps):
                run_step()
        return read_trace(log_dir, hlo_instructions(hlo_text))


def static_collectives(hlo_text: str) -> Dict[str, Tuple[int, int]]:
    """Fallback without a trace: kind -> (instructions, result bytes) in the compiled HLO text.
    Static: an instruction inside a loop body (the scanned layers) is counted once."""
    out = collections.defaultdict(lambda: [0, 0])
    for opcode, size in hlo_instructions(hlo_text).values():
        kind = collective_kind(opcode)
        if kind and not opcode.endswith("-done"):
            out[kind][0] += 1
            out[kind][1] += size
    return {k: tuple(v) for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# one layout


@dataclasses.dataclass
class Row:
    layout: str
    devices: int
    mesh: object
    run_step: Callable[[], None]      # one training step, blocking
    hlo: str                          # the compiled step's HLO text
    compile_s: float                  # first call: trace + compile + one step
    seconds: float = float("inf")     # best step time over all rounds
    cores: float = 0.0                # process CPU time / wall time while timing
    profile: Optional[Profile] = None
    profile_error: str = ""


def prepare_layout(name: str, mesh_cfg: MeshConfig, n: int, configs, batch: int,
                   seq: int) -> Row:
    """The sharded train state on the first ``n`` devices, its step compiled and run once."""
    model_cfg, optim_cfg, run_cfg = configs
    mesh = make_mesh(mesh_cfg, devices=jax.devices()[:n])
    model, optimizer, _ = build(model_cfg, optim_cfg, run_cfg, mesh)
    step = make_train_step()
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch, seq + 1))
    tokens = tokens.astype(np.int32)
    with activate(mesh):
        data = device_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)

    def run_step():
        with activate(mesh):          # the context the step was traced in: no retrace
            jax.block_until_ready(step(model, optimizer, data))

    t0 = time.perf_counter()
    run_step()
    compile_s = time.perf_counter() - t0
    with activate(mesh):
        hlo = step.lower(model, optimizer, data).compile().as_text()   # cached: no recompile
    return Row(name, n, mesh, run_step, hlo, compile_s)


def time_rounds(rows: Sequence[Row], rounds: int, steps: int) -> None:
    """Best step time of every layout over ``rounds`` round-robin rounds of ``steps`` timed
    steps each (``time_fn``: a warm-up step, then the best of ``steps``), so that a burst of
    load on a shared machine or its drift hits all layouts alike; also the CPU cores the
    process kept busy meanwhile."""
    cpu, wall = collections.defaultdict(float), collections.defaultdict(float)
    for _ in range(rounds):
        for row in rows:
            c0, w0 = time.process_time(), time.perf_counter()
            row.seconds = min(row.seconds, time_fn(row.run_step, steps))
            cpu[id(row)] += time.process_time() - c0
            wall[id(row)] += time.perf_counter() - w0
    for row in rows:
        row.cores = cpu[id(row)] / wall[id(row)]


# --------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny.gin", help="model-size gin file")
    p.add_argument("--variant", default="variants/dag_g64_l2.gin", help="variant gin file")
    p.add_argument("--gin", action="append", default=[],
                   help="extra gin binding, e.g. \"ExpertConfig.dispatch='dropless'\" (repeatable)")
    p.add_argument("--batch", type=int, default=16, help="global batch rows (all devices)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout and round")
    p.add_argument("--rounds", type=int, default=4,
                   help="round-robin rounds over the layouts; s/step is the best of all")
    p.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
    p.add_argument("--no-profile", action="store_true", help="skip the collective profile")
    p.add_argument("--quick", action="store_true",
                   help="1 and 8 devices, batch 8 x 128, 2 rounds of 2 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.devices, args.batch, args.seq, args.steps, args.rounds = "1,8", 8, 128, 2, 2
    counts = [int(c) for c in args.devices.split(",") if c.strip()]
    if not counts or min(counts) < 1 or max(counts) > jax.device_count():
        p.error(f"--devices {args.devices}: expected counts from 1 to {jax.device_count()} (set "
                f"XLA_FLAGS={_DEVICE_FLAG}=N before running for more)")

    model_cfg, _, optim_cfg, run_cfg = load_configs([args.model, args.variant], args.gin)
    configs = (model_cfg, optim_cfg, run_cfg)
    tokens = args.batch * args.seq
    simulated = jax.devices()[0].platform == "cpu"
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}"
          + (f" (simulated: all share this machine's {os.cpu_count()} cores)" if simulated else ""))
    print(f"model {args.model} + {args.variant}: {model_cfg.num_layers} layers, d "
          f"{model_cfg.d_model}, {model_cfg.block.experts.num_experts} experts top-"
          f"{model_cfg.block.router.top_k}, {model_cfg.block.experts.dispatch} dispatch; batch {args.batch} "
          f"x {args.seq} tokens; full AdamW step, best of {args.rounds} rounds x {args.steps} "
          f"steps\n")

    rows: List[Row] = []
    for n in counts:
        for name, mesh_cfg in layouts(n):
            why = misfit(model_cfg, mesh_cfg, args.batch)
            if why:
                print(f"  skipped {name}: {why}", flush=True)
                continue
            t0 = time.perf_counter()
            rows.append(prepare_layout(name, mesh_cfg, n, configs, args.batch, args.seq))
            print(f"  compiled {name} (compile + first step {rows[-1].compile_s:.1f} s; "
                  f"{time.perf_counter() - t0:.1f} s with the sharded init)", flush=True)
    t0 = time.perf_counter()
    time_rounds(rows, args.rounds, args.steps)
    print(f"  timed {len(rows)} layouts in {args.rounds} rounds of {args.steps} steps "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if not args.no_profile:
        t0 = time.perf_counter()
        for row in rows:
            try:
                row.profile = profile_collectives(row.run_step, row.hlo)
            except RuntimeError as e:   # no per-instruction events: the HLO counts stand in
                row.profile_error = str(e)
                print(f"  profile of {row.layout} not usable ({e}): HLO counts instead", flush=True)
        print(f"  profiled {PROFILED_STEPS} steps of each ({time.perf_counter() - t0:.1f} s)",
              flush=True)

    base = next((r.seconds for r in rows if r.devices == 1), None)
    print(f"\n{'layout':<24}{'devices':>8}{'s/step':>9}{'tokens/s':>10}{'vs 1 device':>13}"
          f"{'collectives':>13}{'waiting':>9}{'CPU cores busy':>16}")
    for r in rows:
        speed = f"{base / r.seconds:.2f}x" if base else "-"
        share = f"{r.profile.share:.1%}" if r.profile else "-"
        wait = f"{r.profile.wait_share:.1%}" if r.profile else "-"
        print(f"{r.layout:<24}{r.devices:>8}{r.seconds:>9.3f}{tokens / r.seconds:>10,.0f}"
              f"{speed:>13}{share:>13}{wait:>9}{r.cores:>16.2f}")
    print()
    if not args.no_profile:
        print("'collectives': share of each device's step inside collective instructions "
              "(profiler trace, mean over devices);\n'waiting': the part of it spent at a "
              "rendezvous until the other devices arrive.")
    print("'CPU cores busy': this process's CPU time / wall time while the layout was timed.")
    if simulated and max(counts) > 1:
        print(f"Simulated devices share the same {os.cpu_count()} cores: more devices add no "
              f"compute, and a device waits at each collective while the cores run the others' "
              f"work.\nThis measures the overheads of the parallel program (partitioning, "
              f"communication), not real scaling; a speed-up above 1x means the devices' "
              f"programs kept more cores busy than one device's program does.")

    multi = [r for r in rows if r.devices > 1]
    traced = [r for r in multi if r.profile]
    if traced:
        print("\ncollectives by kind, per step and device (profiler trace): share of the step, "
              "instructions executed, MB they return")
        print(f"{'layout':<24}{'devices':>8}" + "".join(f"{k:>24}" for k in COLLECTIVES))
        for r in traced:
            cells = [f"{r.profile.by_kind.get(k, 0):.1%} {r.profile.count[k]:.0f}x "
                     f"{r.profile.nbytes[k] / 1e6:.2f}MB" if r.profile.count.get(k) else "-"
                     for k in COLLECTIVES]
            print(f"{r.layout:<24}{r.devices:>8}" + "".join(f"{c:>24}" for c in cells))
    untraced = [r for r in multi if not r.profile]
    if untraced:
        why = "--no-profile" if args.no_profile else "no usable profile"
        print(f"\ncollectives by kind from the compiled HLO text (NOT timed: {why}; static "
              f"counts, an instruction in the scanned layer loop counted once): instructions, "
              f"MB they return")
        print(f"{'layout':<24}{'devices':>8}" + "".join(f"{k:>24}" for k in COLLECTIVES))
        for r in untraced:
            static = static_collectives(r.hlo)
            cells = [f"{static[k][0]}x {static[k][1] / 1e6:.2f}MB" if k in static else "-"
                     for k in COLLECTIVES]
            print(f"{r.layout:<24}{r.devices:>8}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
