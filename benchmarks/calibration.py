"""Published, measured MaxText runs compiled on this CPU and costed by our roofline: the
calibration set behind ``dagmoe_jax.compile.calibration``'s predicted step times.

Each run is a MaxText recipe of AI-Hypercomputer/tpu-recipes (commit ``RECIPES_COMMIT``) whose
README logs a measured step ("completed step: N, seconds: S, ...") and names the exact
workload: the model, per-device batch, sequence, remat and offload policy, mesh, dispatch
and the XLA flags (``benchmarks/xla_flags_library.py`` of MaxText, commit ``MAXTEXT_COMMIT``;
transcribed in ``XLA_FLAGS``). ``--compile`` runs MaxText 0.2.5's own ``train_compile`` for
each (deviceless, the side environment of ``benchmarks/setup_maxtext.sh``, one libtpu for all,
the flags in ``LIBTPU_INIT_ARGS``), keeping the HLO; ``--cost`` costs each kept program with
``dagmoe_jax.compile.roofline`` and prints the terms ``dagmoe_jax/compile/calibration.py``
stores, with measured / estimate and the fit.

    bash benchmarks/setup_maxtext.sh /tmp/maxtext-env                 # once
    python -m benchmarks.calibration --compile --out /tmp/cal          # ~6 min a run, 2 cores
    python -m benchmarks.calibration --cost --out /tmp/cal             # the table

The recipes ran older MaxText commits (named per run); the program compiled here is MaxText
0.2.5's for the same configuration, so a difference between the two versions' programs is
part of the error the calibration reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RECIPES_COMMIT = "c8cfe2f689081d36701a101cd73a70965d80926b"
MAXTEXT_COMMIT = "e591f30cbbf217ed67ef71263ec0538239f9c3b8"

XLA_FLAGS = {   # MaxText's benchmarks/xla_flags_library.py, the groups the runs name
    "DENSE_VMEM_LIMIT_FLAG": "--xla_tpu_scoped_vmem_limit_kib=98304",
    "MOE_VMEM_LIMIT_FLAG": "--xla_tpu_scoped_vmem_limit_kib=81920",
    "CF_FOR_ALL_GATHER": (
        "--xla_tpu_enable_async_collective_fusion=true "
        "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
        "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
        "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"),
    "DATA_PARALLEL_OVERLAP": (
        "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
        "--xla_tpu_data_parallel_opt_different_sized_ops=true"),
    "LAYOUT_FOR_ALL_REDUCE_SCATTER": (
        "--xla_tpu_use_minor_sharding_for_major_trivial_input=true "
        "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 "
        "--xla_tpu_assign_all_reduce_scatter_layout=true"),
    "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE": (
        "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false "
        "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
        "--xla_tpu_enable_all_reduce_offload_tracing=true "
        "--xla_tpu_use_tc_device_shape_on_sc=true --xla_sc_enable_instruction_fusion=false "
        "--xla_sc_disjoint_spmem=false --xla_sc_disable_megacore_partitioning=true"),
    "HOST_OFFLOAD_FLAGS": (
        "--xla_tpu_enable_all_experimental_scheduler_features=true "
        "--xla_tpu_enable_scheduler_memory_pressure_tracking=true "
        "--xla_tpu_host_transfer_overlap_limit=24 "
        "--xla_tpu_aggressive_opt_barrier_removal=ENABLED "
        "--xla_lhs_prioritize_async_depth_over_stall=ENABLED "
        "--xla_tpu_enable_ag_backward_pipelining=true "
        "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED "
        "--xla_should_add_loop_invariant_op_in_chain=ENABLED "
        "--xla_max_concurrent_host_send_recv=100 "
        "--xla_tpu_scheduler_percent_shared_memory_limit=100 "
        "--xla_latency_hiding_scheduler_rerun=2"),
    "DISABLE_COLLECTIVE_MATMUL": "--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000",
}

_SPLASH = {f"sa_block_{k}": 2048 for k in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv",
                                             "kv_dkv_compute", "q_dq", "kv_dq")}
_OFFLOAD_ALL = {k: "offload" for k in ("decoder_layer_input", "out_proj", "query_proj",
                                        "key_proj", "value_proj")}
_DENSE_V6E = dict(remat_policy="custom", **_OFFLOAD_ALL, max_target_length=8192,
                  attention="flash", use_iota_embed=True, **_SPLASH,
                  sa_use_fused_bwd_kernel=True, ici_fsdp_parallelism=-1)
_DENSE_V6E_FLAGS = ("DENSE_VMEM_LIMIT_FLAG", "LAYOUT_FOR_ALL_REDUCE_SCATTER",
                    "DATA_PARALLEL_OVERLAP", "CF_FOR_ALL_GATHER",
                    "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE", "HOST_OFFLOAD_FLAGS",
                    "DISABLE_COLLECTIVE_MATMUL")
_MIXTRAL = dict(remat_policy="custom", **_OFFLOAD_ALL, max_target_length=4096,
                attention="flash", use_iota_embed=True, sa_block_q=2048, sa_block_q_dkv=2048,
                sa_block_q_dq=2048, megablox=False, sparse_matmul=False, capacity_factor=1.25)
_LLAMA4 = dict(max_target_length=8192, dtype="bfloat16", weight_dtype="float32",
               megablox=True, sparse_matmul=True, opt_type="adamw", remat_policy="custom",
               **_SPLASH)
_LLAMA4_FLAGS = ("MOE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "DATA_PARALLEL_OVERLAP",
                 "LAYOUT_FOR_ALL_REDUCE_SCATTER", "HOST_OFFLOAD_FLAGS")

_T = "training/trillium/"
RUNS = {   # name: the recipe's README, its log line's seconds, device type, slices, workload
    "llama3.1-8b v6e-8": dict(
        source=_T + "Llama3.1-8B-MaxText/v6e-8/README.md", seconds=3.443, device="v6e-8",
        moe=False, model="llama3.1-8b", tuning=dict(_DENSE_V6E, per_device_batch_size=3),
        flags=_DENSE_V6E_FLAGS),
    "mistral-7b v6e-8": dict(
        source=_T + "Mistral-7B-MaxText/README.md", seconds=6.320, device="v6e-8",
        moe=False, model="mistral-7b", tuning=dict(_DENSE_V6E, per_device_batch_size=6),
        flags=_DENSE_V6E_FLAGS),
    "llama3.1-70b v6e-32": dict(
        source=_T + "Llama3.1-70B-MaxText/v6e-32/README.md", seconds=17.790, device="v6e-32",
        moe=False, model="llama3.1-70b",
        tuning=dict({k: v for k, v in _DENSE_V6E.items() if k != "out_proj"},
                    per_device_batch_size=2, weight_dtype="bfloat16"),
        flags=tuple(f for f in _DENSE_V6E_FLAGS
                    if f != "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE")),
    "mixtral-8x7b v6e-256": dict(
        source=_T + "Mixtral-8x7B-MaxText/README.md", seconds=13.484, device="v6e-256",
        moe=True, model="mixtral-8x7b",
        tuning=dict(_MIXTRAL, per_device_batch_size=12, ici_fsdp_parallelism=-1),
        flags=("MOE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "DATA_PARALLEL_OVERLAP")),
    "mixtral-8x22b v6e-256": dict(
        source=_T + "Mixtral-8x22B-MaxText/README.md", seconds=24.706, device="v6e-256",
        moe=True, model="mixtral-8x22b",
        tuning=dict(_MIXTRAL, per_device_batch_size=8, ici_fsdp_parallelism=64,
                    ici_expert_parallelism=4, dtype="bfloat16", weight_dtype="bfloat16",
                    allow_split_physical_axes=True, custom_mesh="hybrid_ring_64x4"),
        flags=("MOE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "DATA_PARALLEL_OVERLAP")),
    "llama4-scout v5p-1024": dict(
        source="training/v5p/Llama4-Scout-17B-16E-Maxtext/README.md", seconds=31.652,
        device="v5p-1024", moe=True, model="llama4-17b-16e",
        tuning=dict(_LLAMA4, per_device_batch_size=8, ici_fsdp_parallelism=-1,
                    decoder_layer_input="offload"),
        flags=_LLAMA4_FLAGS),
    "llama4-maverick v5p-256": dict(
        source="training/v5p/Llama4-Maverick-17B-128E-Maxtext/README.md", seconds=24.792,
        device="v5p-256", moe=True, model="llama4-17b-128e",
        tuning=dict(_LLAMA4, **_OFFLOAD_ALL, per_device_batch_size=4,
                    ici_fsdp_parallelism=32, ici_tensor_parallelism=4),
        flags=_LLAMA4_FLAGS),
    "llama3.1-405b v5p-1024": dict(   # not in the shipped set: not compiled on 2026-12-06
        source="training/v5p/Llama3.1-405B-MaxText/README.md", seconds=131.474,
        device="v5p-1024", moe=False, model="llama3.1-405b",
        tuning=dict(per_device_batch_size=2, ici_fsdp_parallelism=-1, max_target_length=8192,
                    attention="flash", use_iota_embed=True, remat_policy="custom",
                    context="offload", mlpwo="offload", num_vocab_tiling=4, **_SPLASH),
        flags=("DENSE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "HOST_OFFLOAD_FLAGS")),
}
HELD_OUT = ("mistral-7b v6e-8", "llama4-maverick v5p-256")
"""Runs kept out of the fit: one dense on v6e, one MoE on v5p."""


def _flag(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def libtpu_flags(run: dict) -> str:
    """The run's XLA flags for ``LIBTPU_INIT_ARGS``, less the continuation fusion of
    all-gathers (``xla_tpu_enable_async_collective_fusion*``): libtpu 0.0.48 refuses it on
    v6e ("ghostlite") and v5p ("viperfish") alike ("not supported/recommended on platforms
    other than Viperlite"), though the recipes' older libtpu took it."""
    flags = [f for f in " ".join(XLA_FLAGS[f] for f in run["flags"]).split()
             if "async_collective_fusion" not in f]
    return " ".join(flags)


def maxtext_args(run: dict) -> list:
    """``train_compile``'s command-line overrides for one run (its workload, deviceless)."""
    flags = dict(compile_topology=run["device"], compile_topology_num_slices=1,
                 model_name=run["model"], run_name="calibration",
                 base_output_directory="/tmp/calibration", dataset_type="synthetic",
                 enable_checkpointing=False, **run["tuning"])
    return [f"{k}={_flag(v)}" for k, v in flags.items()]


def compile_run(name: str, run: dict, out: Path, python: str) -> str:
    """Compile one run with MaxText's ``train_compile`` into ``out/<name>/`` (its HLO and
    stats); the outcome in words."""
    where = out / name.replace(" ", "_")
    if (where / "hlo.txt").exists():
        return "kept from before"
    where.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_WORKER_HOSTNAMES="localhost",
               TPU_ACCELERATOR_TYPE=run["device"],
               LIBTPU_INIT_ARGS=libtpu_flags(run))
    for key in ("PYTHONPATH", "TPU_LIBRARY_PATH"):
        env.pop(key, None)
    driver = Path(__file__).with_name("maxtext_compile.py")
    start = time.time()
    proc = subprocess.run([python, str(driver), "--driver", str(where), *maxtext_args(run)],
                          env=env, capture_output=True, text=True)
    (where / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if line.strip()][-2:]
        return "failed: " + " | ".join(tail)[-300:]
    return f"compiled in {time.time() - start:.0f} s"


def cost_run(name: str, run: dict, out: Path) -> dict:
    """The kept program's roofline terms (``dagmoe_jax.compile.calibration.terms``), its chip
    and the compiler's own FLOP count."""
    from dagmoe_jax.compile.calibration import terms
    from dagmoe_jax.compile.chips import parse_topology
    chip, grid = parse_topology(run["device"])
    chips = 1
    for g in grid:
        chips *= g
    where = out / name.replace(" ", "_")
    t = terms((where / "hlo.txt").read_text(), chip, chips)
    stats = json.loads((where / "stats.json").read_text())
    return dict(t, chip=chip.name, chips=chips, compiler_flops=stats["flops"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile", action="store_true", help="compile every run not yet kept")
    p.add_argument("--cost", action="store_true", help="cost the kept programs; the table")
    p.add_argument("--out", default="/tmp/calibration", help="where programs are kept")
    p.add_argument("--only", action="append", default=[], help="these runs only (repeatable)")
    p.add_argument("--maxtext_python", default=os.environ.get(
        "MAXTEXT_PYTHON", "/tmp/maxtext-env/venv/bin/python"))
    args = p.parse_args(argv)
    out = Path(args.out)
    names = args.only or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"error: no run named {unknown[0]!r}; the runs: {', '.join(RUNS)}",
              file=sys.stderr)
        return 2
    if args.compile:
        if not Path(args.maxtext_python).exists():
            print(f"error: no MaxText side environment at {args.maxtext_python}: run "
                  f"bash benchmarks/setup_maxtext.sh first", file=sys.stderr)
            return 2
        for name in names:
            print(f"{name}: {compile_run(name, RUNS[name], out, args.maxtext_python)}",
                  flush=True)
    if args.cost:
        from dagmoe_jax.compile.calibration import GPU_RUNS, CalibrationRun, describe_fit
        runs = []
        for name in names:
            if not (out / name.replace(" ", "_") / "hlo.txt").exists():
                print(f"{name}: not compiled (run --compile first)")
                continue
            run, t = RUNS[name], cost_run(name, RUNS[name], out)
            runs.append(CalibrationRun(
                name, run["source"], t["chip"], run["moe"], run["seconds"],
                *(round(t[k], 4) for k in ("compute", "matmul_bound", "collectives",
                                           "offload")), held_out=name in HELD_OUT,
                exchange=round(t["exchange"], 4)))
            print(f"{name}: {t['matmul_flops'] / 1e12:.0f} TFLOP of matmuls (the compiler "
                  f"{t['compiler_flops'] / 1e12:.0f}), {t['hbm_bytes'] / 1e9:.0f} GB of HBM "
                  f"traffic, {t['offload_bytes'] / 1e9:.1f} GB to and from the host", flush=True)
        if runs:
            print(describe_fit(runs))
            print("\nTPU_RUNS for dagmoe_jax/compile/calibration.py:")
            for r in runs:
                print(f"    CalibrationRun({r.name!r}, _R + {r.source.removeprefix('training/')!r},"
                      f" {r.chip!r}, {r.moe}, {r.measured}, {r.compute}, {r.matmul_bound}, "
                      f"{r.collectives}, {r.offload}{', held_out=True' if r.held_out else ''}"
                      f"{f', exchange={r.exchange}' if r.exchange else ''}),")
        print("\nthe GPU calibration (H200):")
        print(describe_fit(GPU_RUNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
