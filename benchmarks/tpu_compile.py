"""The paper's models compiled by the TPU or GPU compiler on this host, side by side.

Each row runs ``python -m dagmoe_jax.compile`` in its own process (the training step only) and
reads its JSON: per-chip HBM, the compiler's flops and bytes, collective bytes, the roofline's
sum and floor (dagmoe_jax/compile/roofline.py) and the predicted step with its range
(dagmoe_jax/compile/calibration.py), with tokens/s and MFU at the prediction. A ``ratio``
column divides each row's predicted step time by the MoE + shared expert row of the same model
and topology (the paper's parity baseline: DAG-MoE L 2 measured +4.49% on A100).

    python -m benchmarks.tpu_compile --models l --batch 512 --binding RunConfig.grad_accum=16 \
        --mesh "data=2,expert=2" --mesh "data=1,fsdp=2,expert=2"    # the paper's batch, v5p-8
    python -m benchmarks.tpu_compile --models s m --batch 256 --binding RunConfig.grad_accum=8
    python -m benchmarks.tpu_compile --models l --variants moe --hlo_dir /tmp/hlo   # keep the HLO
    python -m benchmarks.tpu_compile --topology h100 --models s l --batch 16 --seq 1024 \
        --mesh data=1 --binding ExecutionConfig.remat=dots     # one H100, gpu.gin's remat

The paper's batches are 256 (s, m) and 512 (l) sequences of 2,048 tokens; on v5p-8 they run as
micro-batches of 32 (``RunConfig.grad_accum``). Compiling the l model's training step took
90-290 s a row on the 2-core CPU (RESULTS.md). ``benchmarks/maxtext_compile.py`` compiles
MaxText's step beside ours.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {
    "moe": ["variants/moe.gin"],
    "moe+shared": ["variants/moe_shared_g128_l2.gin"],
    "dag L2": ["variants/dag_g128_l2.gin"],
    "coe": ["variants/coe_g128_l2.gin"],
    "moe cap": ["variants/moe.gin"],
    "moe ragged": ["variants/moe.gin"],
    "deepseek": ["variants/deepseek.gin"],
}
VARIANT_BINDINGS = {
    "moe cap": ["ExpertConfig.dispatch='capacity'"],          # drops tokens: the speed to beat
    "moe ragged": ["ExecutionConfig.grouped_matmul='ragged_dot'"],   # XLA's lowering
    # DeepSeek's choices (variants/deepseek.gin) with latent attention sized for d 1024 as
    # DeepSeek-V2-Lite is for d 2048 (16 heads, d_c 256, 64 + 32 query and key dimensions, 64
    # value ones), fine-grained experts (twice as many, half as wide, top 2K: 64 of 256, top-8
    # at l, in 8 groups of which 4 are kept, two shared ones of 256), without the multi-token
    # prediction module (the step MaxText compiles by default has none)
    "deepseek": ["NUM_EXPERTS=64", "EXPERT_HIDDEN=256", "RouterConfig.top_k=8",
                 "RouterConfig.n_group=8", "RouterConfig.topk_group=4",
                 "ExpertConfig.num_shared=2",
                 "ModelConfig.num_heads=16", "ModelConfig.num_kv_heads=16",
                 "MLAConfig.kv_lora_rank=256", "MLAConfig.qk_nope_head_dim=64",
                 "MLAConfig.qk_rope_head_dim=32", "MLAConfig.v_head_dim=64",
                 "MTPConfig.depth=0"],
}


def parse_mesh(text: str) -> dict:
    """'data=2,expert=2' -> {'data': 2, 'expert': 2} (the axes named, in order)."""
    sizes = {}
    for part in text.split(","):
        if part.strip():
            axis, size = part.split("=")
            sizes[axis.strip()] = int(size)
    return sizes


def run_row(model: str, variant: str, topology: str, batch: int, seq: int, mesh: str,
            extra, hlo_dir: str = "") -> dict:
    bindings = ["--gin.ModelConfig.compute_dtype='bfloat16'",
                f"--gin.DataConfig.batch_size={batch}", f"--gin.DataConfig.seq_len={seq}"]
    bindings += [f"--gin.MeshConfig.{axis}={size}" for axis, size in parse_mesh(mesh).items()]
    bindings += [f"--gin.{b}" for b in VARIANT_BINDINGS.get(variant, ())]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "dagmoe_jax.compile", f"--gin_file=models/{model}.gin",
               *[f"--gin_file={g}" for g in VARIANTS[variant]], *bindings, *extra,
               f"--topology={topology}", "--programs=train", f"--json={out}"]
        if hlo_dir:
            row = f"{model}_{variant}_{mesh}".replace(" ", "").replace(",", "_")
            cmd.append(f"--hlo_dir={Path(hlo_dir) / row}")
        tick = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - tick
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1],
                    "wall": seconds}
        report = json.loads(out.read_text())
    report["wall"] = seconds
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["s", "m", "l"])
    p.add_argument("--variants", nargs="+", default=["moe", "moe+shared", "dag L2", "coe"],
                   choices=list(VARIANTS))
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mesh", action="append", default=[],
                   help="mesh sizes, e.g. 'data=2,expert=2' (repeatable; default that)")
    p.add_argument("--binding", action="append", default=[],
                   help="an extra gin binding for every row, e.g. ExecutionConfig.remat='dots'")
    p.add_argument("--json", default="")
    p.add_argument("--hlo_dir", default="", help="keep each row's compiled HLO text here")
    args = p.parse_args(argv)
    meshes = args.mesh or ["data=2,expert=2"]
    extra = [f"--gin.{b.replace(' ', '')}" for b in args.binding]
    env_note = os.environ.get("XLA_FLAGS", "")
    rows = []
    from dagmoe_jax.compile.calibration import predict
    from dagmoe_jax.compile.chips import parse_topology
    chip, _ = parse_topology(args.topology)
    print(f"{'model':<6}{'variant':<12}{'mesh':<26}{'GB/chip':>8}{'state':>7}{'TFLOP':>8}"
          f"{'comp.TF':>8}{'GB acc':>8}{'coll GB':>8}{'sum ms':>9}{'floor ms':>9}"
          f"{'pred. ms (range)':>22}{'tok/s':>12}{'MFU':>7}"
          f"{'ratio':>7}{'DAG ms':>8}{'launch':>7}{'disp ms':>8}{'wall s':>7}", flush=True)
    for model in args.models:
        baseline = {}
        for mesh in meshes:
            for variant in args.variants:
                r = run_row(model, variant, args.topology, args.batch, args.seq, mesh, extra,
                            args.hlo_dir)
                rows.append({"model": model, "variant": variant, "mesh": mesh, **r})
                if "error" in r:
                    print(f"{model:<6}{variant:<12}{mesh:<26}  {r['error']}", flush=True)
                    continue
                t = r["programs"]["train"]
                m, f, e = t["memory_per_chip"], t["flops_per_chip"], t["estimate"]
                coll = sum(c["bytes"] for c in t["collectives"].values())
                pred = predict(e["overlapped_seconds"], chip)
                seconds = pred.seconds if pred else e["seconds"]
                if variant == "moe+shared":
                    baseline[mesh] = seconds
                ratio = (f"{seconds / baseline[mesh]:.3f}" if mesh in baseline else "")
                span = (f"{pred.seconds * 1e3:.1f} ({pred.low_seconds * 1e3:.0f}-"
                        f"{pred.high_seconds * 1e3:.0f})" if pred else "-")
                dag = t.get("dag_module") or {}
                dag_ms = f"{dag['seconds'] * 1e3:.2f}" if dag else ""
                launches = str(dag.get("launches", ""))
                part = t.get("dispatch") or {}
                disp_ms = (f"{(part['seconds'] + part['collective_seconds']) * 1e3:.1f}"
                           if part else "")
                print(f"{model:<6}{variant:<12}{mesh:<26}{m['total'] / 1e9:>8.1f}"
                      f"{m['state'] / 1e9:>7.1f}{f['roofline_matmul'] / 1e12:>8.2f}"
                      f"{f['compiler'] / 1e12:>8.2f}"
                      f"{t['bytes_accessed_per_chip']['roofline_hbm'] / 1e9:>8.1f}"
                      f"{coll / 1e9:>8.2f}{e['seconds'] * 1e3:>9.1f}"
                      f"{e['overlapped_seconds'] * 1e3:>9.1f}{span:>22}"
                      f"{args.batch * args.seq / seconds:>12,.0f}"
                      f"{e['mfu'] * e['seconds'] / seconds:>7.1%}{ratio:>7}"
                      f"{dag_ms:>8}{launches:>7}{disp_ms:>8}{r['wall']:>7.0f}", flush=True)
    compiler = next((r.get("compiler") for r in rows if "compiler" in r), "unknown")
    print(f"topology {args.topology}, batch {args.batch} x {args.seq}, bf16, {compiler}"
          f"{', XLA_FLAGS=' + env_note if env_note else ''}")
    unit = predict(1.0, chip)
    print("tok/s, MFU and ratio from the predicted step (compile/calibration.py): "
          + (f"{unit.calibration.scale:.2f} x the floor, calibration runs "
             f"{unit.calibration.spread()} over {len(unit.calibration.fit_runs)} runs on "
             f"{'/'.join(unit.calibration.chips)}"
             + ("" if unit.verified else f"; no calibration run on {chip.name}")
             if unit else "no calibration: from the roofline's sum"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
