"""Compile a run for a TPU topology or an NVIDIA GPU on this host, and report what each chip
would hold and do.

    python -m dagmoe_jax.compile --gin_file=models/l.gin --gin_file=variants/dag_g128_l2.gin \\
        --gin.ModelConfig.compute_dtype="'bfloat16'" --gin.DataConfig.batch_size=32 \\
        --gin.DataConfig.seq_len=2048 --gin.MeshConfig.expert=2 --topology=v5p:2x2x1
    python -m dagmoe_jax.compile --gin_file=models/s.gin \\
        --gin.ModelConfig.compute_dtype="'bfloat16'" --topology=h100

(console script: ``dagmoe-compile``). A TPU topology needs the TPU compiler, ``pip install
'jax[tpu]==<jax>'``; a GPU one the CUDA plugin, ``pip install --no-deps
jax-cuda13-plugin==<jax> jax-cuda13-pjrt==<jax>`` (requirements-gpu-compile.txt), and CUDA's
``ptxas``. Neither needs the accelerator: the programs are compiled for the topology's devices
with nothing materialised (a GPU's without autotuning: the program's structure, memory and
kernels are the GPU's, its GEMM tilings the compiler's defaults).

Flags:
  --gin_file=FILE, --gin.NAME.PARAM=VAL, --gin_bindings=...   train.py's configuration
  --topology=NAME     v5p:2x2x1 (default), v5p:4x4x4, v5e:4x4, v6e:8x8, ..., or the
                      accelerator type (v5p-8, v6e-256); h100, h200, a100 (SXM4, 80-gigabyte),
                      h100:8 (one 8-GPU node)
  --num_slices=N      N slices of that topology (multi-slice; data parallelism spans them)
  --programs=LIST     of train,eval,prefill,decode (default all four)
  --gen_batch=B --prompt_len=P --new_tokens=N   the generation programs' shapes
                      (default 8 prompts of seq_len / 2 tokens, seq_len / 2 new ones)
  --json=PATH         also write the report as JSON
  --hlo_dir=DIR       also write each compiled program's HLO text
  --search            compile the training step under every mesh the chips factor into
                      (data / fsdp / expert / tensor) and the per-chip batch sizes of
                      --batch_per_chip; print them ranked by predicted tokens/s (with each
                      mesh's compute and collective time, and which of the top ones the
                      prediction's error cannot order) and the gin bindings of the best
  --batch_per_chip=LIST   per-chip batch sizes to search (default: the run's, half, double)
  --search_budget=S   stop the search after S seconds (default 1800)
  --search_buffers=LIST   ExpertConfig.exchange_buffer values a dropless model also tries on
                      meshes with an expert axis ('none': the worst case; default 1.25;
                      '' none but the run's own)
  --search_cache=DIR  where the search keeps each outcome, keyed by the configuration, the
                      topology and libtpu's version, so a search run again compiles only what
                      it has not (default ~/.cache/dagmoe_jax/compile; '' keeps nothing)

Each program's report, per chip: parameters and optimizer state, temporaries and the total
against the chip's HBM; model FLOPs (model.accounting), the compiler's flops and bytes
accessed; each collective's count and bytes; the Mosaic kernels; the roofline of the compiled
program (its sum and floor at the chip's datasheet peak, not a step time:
dagmoe_jax/compile/roofline.py and docs/design.md section 8); and the predicted step time with
tokens/s, MFU, the error the calibration runs showed, the runs behind it and the run's
chip-hours (dagmoe_jax/compile/calibration.py).

Exit status: 0 compiled (and fits), 2 invalid configuration, or a program that does not fit
its chip's HBM (one line: by how much, and what to change).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from dagmoe_jax.command_line import (gin_parser, parse_gin_command, parse_or_report,
                                     quiet_background_errors, report_error)
from dagmoe_jax.stopping import output_complete, remove_on_stop, run_command


def parse_args(argv):
    parser = gin_parser()
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--num_slices", type=int, default=1)
    parser.add_argument("--programs", default="train,eval,prefill,decode")
    parser.add_argument("--gen_batch", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=0)
    parser.add_argument("--new_tokens", type=int, default=0)
    parser.add_argument("--json", default="")
    parser.add_argument("--hlo_dir", default="")
    parser.add_argument("--search", action="store_true")
    parser.add_argument("--batch_per_chip", default="")
    parser.add_argument("--search_budget", type=float, default=1800.0)
    parser.add_argument("--search_buffers", default="1.25")
    parser.add_argument("--search_cache", default=str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dagmoe_jax" / "compile"))
    args, args.bindings = parse_gin_command(parser, argv, "python -m dagmoe_jax.compile")
    args.programs = tuple(p.strip() for p in args.programs.split(",") if p.strip())
    args.search_buffers = _buffers(args.search_buffers)
    return args


def _buffers(text: str) -> list:
    """--search_buffers as ExpertConfig.exchange_buffer values, or a one-line ValueError."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    factors = [p for p in parts if p != "none"]
    if not all(re.fullmatch(r"\d+(\.\d*)?", f) and float(f) >= 1 for f in factors):
        raise ValueError(f"--search_buffers={text} is invalid: expected factors >= 1 or "
                         f"'none', comma-separated")
    return [None if p == "none" else float(p) for p in parts]


def gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


GPU_NOTE = ("  compiled without the GPU: no autotuning (XLA's GEMM tilings are its defaults, "
            "and a sort without the device may take XLA's slower fallback algorithm), and no "
            "cuDNN (the Pallas Triton flash attention compiled in its attention's place); the "
            "H200 runs behind the prediction were tuned on the device: its scale holds these "
            "differences only as far as those runs had them")
"""What a deviceless GPU compile differs in from a run on the card (every GPU report)."""


def describe(name: str, report, chip, topology: str, mesh_label: str, steps: int = 0,
             chips: int = 1) -> str:
    """A program's report as a few lines (see the module docstring); ``steps``: the run's
    steps, whose chip-hours the training step's prediction projects."""
    d = report.as_dict(chip)
    m, f, e = d["memory_per_chip"], d["flops_per_chip"], d["estimate"]
    compiler = (f"compiler {f['compiler'] / 1e12:.3f} TFLOP" if f["compiler"] or
                chip.platform == "tpu" else "compiler: no FLOP count (XLA:GPU reports none)")
    lines = [f"{name} on {topology} ({mesh_label}; {chip.card or chip.name}), "
             f"{report.tokens:,} tokens: compiled in {report.compile_seconds:.1f} s",
             f"  memory per chip: state {gb(m['state'])}, temporaries {gb(m['temporaries'])}, "
             f"total {gb(m['total'])} of {gb(m['hbm'])} HBM"
             f"{'' if m['fits'] else ' (DOES NOT FIT)'}",
             f"  per chip: model {f['model'] / 1e12:.3f} TFLOP, {compiler}"
             f" and {gb(d['bytes_accessed_per_chip']['compiler'])} accessed; roofline "
             f"{f['roofline_matmul'] / 1e12:.3f} TFLOP of matmuls, "
             f"{gb(d['bytes_accessed_per_chip']['roofline_hbm'])} of HBM traffic"]
    if d["collectives"]:
        lines.append("  collectives: " + ", ".join(
            f"{k} {int(v['count'])} x = {gb(v['bytes'])}" for k, v in
            sorted(d["collectives"].items())))
    if d["kernels"]:
        lines.append("  kernels: " + ", ".join(
            f"{k} {v}" for k, v in sorted(d["kernels"].items())))
    if report.kernel_resources:
        lines.extend(resource_lines(report))
    if d["dag_module"]:
        dag = d["dag_module"]
        lines.append(f"  DAG module: {dag['seconds'] * 1e3:.2f} ms of the estimate (its matmuls "
                     f"at peak: {dag['seconds_at_peak'] * 1e3:.2f} ms), {gb(dag['hbm_bytes'])} "
                     f"of HBM traffic, {dag['launches']} kernel launches")
    if d["dispatch"]:
        part = d["dispatch"]
        lines.append(f"  MoE dispatch (sorts, gathers, exchanges; not the experts' products): "
                     f"{part['seconds'] * 1e3:.2f} ms of compute + "
                     f"{part['collective_seconds'] * 1e3:.2f} ms of collectives, "
                     f"{gb(part['hbm_bytes'])} of HBM traffic, {part['launches']} launches")
    lines.append(f"  roofline at datasheet peak (not a step time): sum {e['seconds'] * 1e3:.2f} ms "
                 f"(compute {e['compute_seconds'] * 1e3:.2f} + collectives "
                 f"{e['collective_seconds'] * 1e3:.2f}; host transfers "
                 f"{e['offload_seconds'] * 1e3:.2f}), floor {e['overlapped_seconds'] * 1e3:.2f}"
                 f" (overlapped, but for the experts' exchanges)")
    lines.append(prediction_line(report, chip, e, steps if name == "train" else 0, chips))
    if chip.platform == "gpu":
        lines.append(GPU_NOTE)
    return "\n".join(lines)


def prediction_line(report, chip, e: dict, steps: int, chips: int) -> str:
    """The calibrated step time (compile/calibration.py), its MFU, and what it cannot cover."""
    from dagmoe_jax.compile.calibration import UNCALIBRATED_KERNELS, predict
    p = predict(e["overlapped_seconds"], chip)
    if p is None:
        return (f"  no calibration for {chip.platform}: only the roofline above "
                f"({report.tokens / e['seconds']:,.0f} tokens/s at its sum)")
    line = p.line(e["overlapped_seconds"], report.tokens, chips, chip.name, steps)
    head, _, rest = line.partition("\n")
    line = (f"{head}; MFU {report.model_flops / (p.seconds * chip.peak_flops):.1%}"
            + (f"\n{rest}" if rest else ""))
    outside = sorted(k for k in report.cost.kernels if k in UNCALIBRATED_KERNELS)
    if outside:
        line += (f"\n  outside the calibration: {', '.join(outside)} (Pallas kernels no "
                 f"calibration run used; the roofline misprices them: measure on the device)")
    return line


def resource_lines(report) -> list:
    """What ptxas made of the GPU program's kernels (compile/ptxas.py): each Pallas kernel's
    registers, threads and blocks an SM, and spills (Triton's by their ``pallas_call`` names,
    a variant of one suffixed ``__N``; Mosaic GPU's are all ``..._mosaic_gpu_kernel``); of
    XLA's own, how many spill."""
    resources, pallas = report.kernel_resources, report.pallas_kernels

    def threads(name: str):
        base = re.sub(r"__\d+$", "", name)
        if base in pallas:
            return pallas[base]
        return resources[name].threads if "mosaic_gpu" in name else False

    ours = {n: t for n in resources if (t := threads(n)) is not False}
    lines = [f"  ptxas, {name}: {resources[name].describe(t)}" for name, t in sorted(ours.items())]
    xla = {n: r for n, r in resources.items() if n not in ours}
    spilling = sorted((r.spill_stores, n) for n, r in xla.items() if r.spills)
    lines.append(f"  ptxas, XLA's {len(xla)} kernels: "
                 + (f"{len(spilling)} spill (most: {spilling[-1][1]}, {spilling[-1][0]} B)"
                    if spilling else "none spills"))
    return lines


def oom_line(err, chip, topology: str) -> str:
    """The one line for a program that does not fit."""
    name, need, detail = err.args
    what = {"train": "the training step", "eval": "the evaluation step",
            "prefill": "generation's prefill", "decode": "a decode step"}[name]
    fix = ("lower DataConfig.batch_size or raise RunConfig.grad_accum, set "
           "ExecutionConfig.remat='full', or shard parameters and optimizer state with "
           "MeshConfig.fsdp" if name == "train" else
           "lower DataConfig.batch_size or shard the parameters with MeshConfig.fsdp"
           if name == "eval" else "lower --gen_batch, --prompt_len or --new_tokens, or shard "
           "the parameters with MeshConfig.fsdp")
    if need:
        return (f"{what} does not fit a {chip.name} chip on {topology}: it needs at least "
                f"{need / 1e9:.1f} GB, {(need - chip.hbm_bytes) / 1e9:.1f} GB over its "
                f"{chip.hbm_bytes / 1e9:.1f} GB of HBM: {fix}")
    return (f"{what} does not fit a {chip.name} chip on {topology} ({detail}): {fix}")


def main(argv=None) -> int:
    args, code = parse_or_report(parse_args, argv, __doc__)
    if args is None:
        return code
    # the host's own backend stays the CPU: libtpu would otherwise look for a TPU here
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    quiet_background_errors()
    try:
        return _run(args)
    except ValueError as err:          # OutOfMemory is one
        return report_error(err)
    except FileNotFoundError as err:
        return report_error(err)


def _run(args) -> int:
    from dagmoe_jax.compile.chips import mesh_label, topology_devices
    chip, devices = topology_devices(args.topology, args.num_slices)

    from dagmoe_jax.compile.programs import GenerationShape, OutOfMemory, compile_run
    from dagmoe_jax.parallel import make_mesh
    from dagmoe_jax.run.gin import DEFAULT_GIN, load_configs
    model_cfg, data_cfg, optim_cfg, run_cfg = load_configs(args.gin_file or [DEFAULT_GIN],
                                                             args.bindings)
    if run_cfg.init_from:
        from dagmoe_jax.train.init_from import source_model_config
        model_cfg = source_model_config(run_cfg.init_from, model_cfg)
    topology = args.topology + (f" x {args.num_slices} slices" if args.num_slices > 1 else "")
    half = max(data_cfg.seq_len // 2, 1)
    generation = GenerationShape(args.gen_batch, args.prompt_len or half,
                                 args.new_tokens or half)
    if args.search:
        return _search(args, model_cfg, data_cfg, optim_cfg, run_cfg, chip, devices,
                       topology)
    mesh = make_mesh(run_cfg.mesh, devices, args.num_slices)
    label = mesh_label(mesh.shape)
    print(f"compiling for {topology}: {len(devices)} {chip.name} chips, mesh {label}",
          flush=True)
    try:
        execution, reports = compile_run(model_cfg, data_cfg, optim_cfg, run_cfg, mesh, chip,
                                       programs=args.programs, generation=generation,
                                       keep_hlo=bool(args.hlo_dir),
                                       log=lambda m: print(m, flush=True))
    except OutOfMemory as err:
        raise ValueError(oom_line(err, chip, topology)) from None
    from dagmoe_jax.parallel.axes import MeshLayout
    from dagmoe_jax.model.settle import describe as describe_settled
    # with the mesh: the expert-parallel exchange and its receive buffer (what overflows drops)
    settled = describe_settled(model_cfg, execution, run_cfg.execution,
                               backend=chip.platform, layout=MeshLayout.of(mesh),
                               device=devices[0])
    print(f"model settled for {chip.platform}: {settled}")
    for name, report in reports.items():
        print(describe(name, report, chip, topology, label, run_cfg.steps, len(devices)))
    for written in (args.hlo_dir, args.json):
        if written:
            remove_on_stop(written)
    if args.hlo_dir:
        out = Path(args.hlo_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, report in reports.items():
            (out / f"{name}.hlo.txt").write_text(report.hlo)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "topology": args.topology, "num_slices": args.num_slices, "chip": chip.name,
            "chips": len(devices), "mesh": dict(mesh.shape),
            "libtpu": _libtpu_version(), "compiler": _compiler_version(chip), "programs": {n: r.as_dict(chip)
                                                      for n, r in reports.items()}},
            indent=1, default=float))
    output_complete()
    unfit = [n for n, r in reports.items() if r.total_bytes > chip.hbm_bytes]
    if unfit:
        r = reports[unfit[0]]
        raise ValueError(oom_line(OutOfMemory(unfit[0], r.total_bytes, ""), chip, topology))
    return 0


def _source_digest() -> str:
    """A hash of this library's Python sources: a cached search outcome is only as good as the
    code that compiled it."""
    import hashlib
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _compiler_version(chip) -> str:
    """'libtpu X' for a TPU target, 'jaxlib X with jax-cuda13-plugin Y' for a GPU one."""
    from importlib.metadata import version
    if chip.platform == "tpu":
        return f"libtpu {_libtpu_version()}"
    try:
        plugin = version("jax-cuda13-plugin")
    except Exception:
        plugin = "unknown"
    return f"jaxlib {version('jaxlib')} with jax-cuda13-plugin {plugin}"


def _libtpu_version() -> str:
    from importlib.metadata import version
    try:
        return version("libtpu")
    except Exception:
        return "unknown"


def _search(args, model_cfg, data_cfg, optim_cfg, run_cfg, chip, devices, topology) -> int:
    from dagmoe_jax.compile.programs import OutOfMemory, compile_run
    from dagmoe_jax.parallel import MeshConfig, make_mesh
    from dagmoe_jax.compile.calibration import predict
    from dagmoe_jax.compile.search import (OWN, Outcome, OutcomeCache, candidates,
                                           compile_error_line, ranked, search, within_error)
    chips = len(devices)
    own = run_cfg.mesh.resolve(chips)
    if data_cfg.batch_size % chips:
        raise ValueError(f"DataConfig.batch_size={data_cfg.batch_size} is not a multiple of "
                         f"the {chips} chips")
    run_batch = data_cfg.batch_size // chips
    if args.batch_per_chip:
        batches = sorted({int(b) for b in args.batch_per_chip.split(",") if b.strip()})
    else:
        batches = sorted({max(run_batch // 2, 1), run_batch, run_batch * 2})
    todo = candidates(model_cfg, chips, batches, first=(own, run_batch),
                      num_slices=args.num_slices, buffers=args.search_buffers)
    print(f"searching {len(todo)} meshes x batches for {topology} ({chips} {chip.name} chips), "
          f"budget {args.search_budget:.0f} s", flush=True)

    def compile_one(candidate) -> Outcome:
        data = dataclasses.replace(data_cfg, batch_size=candidate.batch_per_chip * chips)
        try:
            mesh = make_mesh(MeshConfig(**candidate.mesh), devices, args.num_slices)
            _, reports = compile_run(candidate.model_config(model_cfg), data, optim_cfg,
                                     run_cfg, mesh, chip, programs=("train",))
        except OutOfMemory as err:
            return Outcome(candidate, error="out of memory" + (
                f" ({err.args[1] / 1e9:.1f} GB)" if err.args[1] else ""))
        except Exception as err:     # the compiler's or JAX's word on this mesh: next one
            return Outcome(candidate, error=compile_error_line(err))
        r = reports["train"]
        d = r.as_dict(chip)["estimate"]
        if r.total_bytes > chip.hbm_bytes:
            return Outcome(candidate, error=f"out of memory ({r.total_bytes / 1e9:.1f} GB)",
                           hbm_bytes=r.total_bytes)
        p = predict(d["overlapped_seconds"], chip)
        seconds = p.seconds if p else d["seconds"]
        return Outcome(candidate, seconds, r.tokens / seconds,
                       r.model_flops / (seconds * chip.peak_flops), r.total_bytes,
                       compute_seconds=d["compute_seconds"],
                       collective_seconds=d["collective_seconds"],
                       floor_seconds=d["overlapped_seconds"])

    train_fields = {f.name: getattr(run_cfg, f.name) for f in dataclasses.fields(run_cfg)
                    if f.name != "mesh"}
    fingerprint = "\n".join(repr(c) for c in (
        model_cfg, data_cfg.seq_len, optim_cfg, train_fields, topology, args.num_slices,
        _compiler_version(chip), _source_digest()))
    cache = OutcomeCache(args.search_cache, fingerprint) if args.search_cache else None
    outcomes = ranked(search(compile_one, todo, budget_seconds=args.search_budget,
                             log=lambda m: print(m, flush=True), cache=cache))
    p = predict(1.0, chip)
    what = "predicted tokens/s" if p else "tokens/s (roofline sum)"
    print(f"{'rank':<5}{'mesh':<46}{'batch/chip':>11}{'compute ms':>11}{'coll. ms':>9}"
          f"{what:>28}{'MFU':>7}{'GB/chip':>9}")
    for i, o in enumerate(outcomes):
        if o.seconds:
            span = (f"{o.tokens_per_second / (1 + p.calibration.high):,.0f}-"
                    f"{o.tokens_per_second / (1 + p.calibration.low):,.0f} "
                    if p else "")
            print(f"{i + 1:<5}{o.candidate.label():<46}{o.candidate.batch_per_chip:>11}"
                  f"{o.compute_seconds * 1e3:>11.2f}{o.collective_seconds * 1e3:>9.2f}"
                  f"{span + format(o.tokens_per_second, ',.0f'):>28}{o.mfu:>7.1%}"
                  f"{o.hbm_bytes / 1e9:>9.1f}")
        else:
            print(f"{'-':<5}{o.candidate.label():<46}{o.candidate.batch_per_chip:>11}  {o.error}")
    if p:
        close = within_error(outcomes, p.calibration.low, p.calibration.high)
        print(f"predicted = {p.calibration.scale:.2f} x the roofline floor, calibration runs "
              f"{p.calibration.spread()}" + (
                  f": the top {len(close)} are within that error of each other (the estimate "
                  f"cannot order them: measure them)" if len(close) > 1 else
                  ": the best is ahead of the rest by more than that error")
              + ("" if p.verified else f"; no calibration run on {chip.name}"))
    best = next((o for o in outcomes if o.seconds), None)
    if args.json:
        remove_on_stop(args.json)
        Path(args.json).write_text(json.dumps([{
            "mesh": o.candidate.mesh, "batch_per_chip": o.candidate.batch_per_chip,
            "bindings": o.candidate.bindings(),
            "seconds": o.seconds, "tokens_per_second": o.tokens_per_second, "mfu": o.mfu,
            "hbm_bytes": o.hbm_bytes, "error": o.error} for o in outcomes], indent=1))
        output_complete()
    if best is None:
        raise ValueError(f"no mesh and batch tried fits {topology}: lower the batch or raise "
                         f"--search_budget")
    own_outcome = next((o for o in outcomes if o.candidate.sizes == tuple(own)
                        and o.candidate.batch_per_chip == run_batch
                        and o.candidate.exchange_buffer == OWN and o.seconds), None)
    speedup = (f", {best.tokens_per_second / own_outcome.tokens_per_second:.2f}x the run's own "
               f"mesh" if own_outcome else "")
    print(f"best: {best.candidate.label()}, batch {best.candidate.batch_per_chip}/chip"
          f"{speedup}; gin bindings:")
    for line in best.candidate.bindings():
        print(f"  {line}")
    return 0


def entry() -> int:
    """The ``dagmoe-compile`` command under the stop contract."""
    return run_command(main)


if __name__ == "__main__":
    sys.exit(run_command(main))
