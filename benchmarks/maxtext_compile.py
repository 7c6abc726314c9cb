"""MaxText's ``train_compile`` beside ours: a training step compiled by the TPU compiler for
the same topology, global batch and mesh, both costed by this library's roofline.

MaxText 0.2.5 runs in a side environment (it needs Python >= 3.12):

    bash benchmarks/setup_maxtext.sh /tmp/maxtext-env            # once, a few minutes
    python -m benchmarks.maxtext_compile --maxtext_python /tmp/maxtext-env/venv/bin/python
    python -m benchmarks.maxtext_compile --mesh "data=2,expert=2" --mesh "fsdp=4"
    python -m benchmarks.maxtext_compile --shape deepseek_l --mesh "data=2,expert=2"

For each mesh it compiles, each in its own process: this library's step (``python -m
dagmoe_jax.compile``, as ``benchmarks/tpu_compile.py`` does) and MaxText's
(``maxtext.trainers.pre_train.train_compile`` with ``DECOUPLE_GCLOUD=TRUE``, run by this file's
``--driver`` mode inside the side environment, which keeps the compiled program's HLO text and
memory analysis). ``--shape moe_l`` (default) is MoE-l's (models/l.gin + variants/moe.gin): 8
layers, d 1024, 32 heads over 8 KV heads, 32 experts of 512, top-4, vocabulary 128,256,
sequence 2048, as MaxText's Mixtral decoder block, which is that block with a softmax router;
``--shape deepseek_l`` the same sizes with DeepSeek's choices (``SHAPES``) as MaxText's DeepSeek
block. Both keep their defaults otherwise (bf16 compute, float32 weights and AdamW, remat
'full', scanned layers, megablox, splash where it applies). The estimate is ours applied to both
compiled programs (with the same grouped-matmul occupancy): compare the ratio, not the absolute
figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Standard library only at the top: the --driver mode runs this file as a script in the side
# environment, where neither this library nor the benchmarks package is importable.
MESH_FLAGS = {"data": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism",
              "expert": "ici_expert_parallelism", "tensor": "ici_tensor_parallelism"}


def parse_mesh(text: str) -> dict:
    """All four axes' sizes of a mesh text such as 'data=2,expert=2' (the others 1)."""
    from benchmarks.tpu_compile import parse_mesh as parse_row_mesh
    return {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, **parse_row_mesh(text)}


def maxtext_flags(cfg, batch: int, seq: int, chips: int, mesh: dict, topology: str) -> list:
    """MaxText's command-line overrides for ``cfg`` (a ModelConfig of the moe block): its
    Mixtral decoder block, or with latent attention its DeepSeek block (MLA, the dense first
    layers, shared experts, sigmoid scores with the selection bias, groups, the scaling)."""
    from dagmoe_jax.compile.chips import parse_topology      # (not in the side environment)
    chip, _ = parse_topology(topology)
    e, r = cfg.block.experts, cfg.block.router
    flags = dict(
        compile_topology=f"{chip.name}-{chips * chip.cores_per_chip}",
        compile_topology_num_slices=1,
        run_name="moe_l", base_output_directory=tempfile.gettempdir(),
        dataset_type="synthetic", enable_checkpointing="false", decoder_block="mixtral",
        base_emb_dim=cfg.d_model, base_num_query_heads=cfg.num_heads,
        base_num_kv_heads=cfg.num_kv_heads, head_dim=cfg.d_model // cfg.num_heads,
        base_mlp_dim=e.expert_hidden, base_moe_mlp_dim=e.expert_hidden,
        base_num_decoder_layers=cfg.num_layers, num_experts=e.num_experts,
        num_experts_per_tok=r.top_k, vocab_size=cfg.vocab_size,
        max_target_length=seq, per_device_batch_size=batch // chips,
        mlp_activations='["silu","linear"]')
    if cfg.mla.enabled:
        m = cfg.mla
        dense = cfg.first_dense_config()
        flags.update(
            run_name="deepseek_l", decoder_block="deepseek", attention_type="mla",
            q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim, head_dim=m.qk_head_dim,
            first_num_dense_layers=cfg.first_dense_layers,
            base_mlp_dim=dense.resolved_ffn_hidden if dense else e.expert_hidden,
            shared_experts=e.num_shared * e.shared_hidden // e.expert_hidden,
            routed_score_func=r.score_fn, routed_bias=str(r.aux_free_bias_rate > 0).lower(),
            routed_scaling_factor=r.routed_scaling_factor,
            n_routing_groups=r.n_group if r.n_group > 1 else -1,
            topk_routing_group=r.topk_group if r.n_group > 1 else -1,
            norm_topk_prob=str(r.renormalize).lower(),
            rope_max_timescale=int(cfg.rope_theta))
    flags.update({MESH_FLAGS[axis]: size for axis, size in mesh.items()})
    return [f"{k}={v}" for k, v in flags.items()]


SHAPES = {   # name: (this library's models/*.gin and tpu_compile variant, what it is)
    "moe_l": ("l", "moe", "MoE-l: 8 layers, d 1024, 32 heads over 8 KV heads, 32 experts of "
              "512, top-4, vocabulary 128,256; MaxText's Mixtral block"),
    "deepseek_l": ("l", "deepseek", "MoE-l's sizes with DeepSeek's choices (variants/"
                   "deepseek.gin, tpu_compile's 'deepseek' bindings): 16 heads of MLA, the "
                   "first layer dense, 64 experts of 256 in 8 groups (4 kept), top-8 by biased "
                   "sigmoid scores, two shared experts of 256; MaxText's DeepSeek block"),
}


def driver(out_dir: str, flags) -> None:
    """Inside the side environment: MaxText's train_compile.main, keeping what it compiled."""
    import maxtext
    from maxtext.trainers.pre_train import train_compile
    kept = {}
    original = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        kept["compiled"] = original(*args, **kwargs)
        return kept["compiled"]

    train_compile.jit_and_compile = keep
    base = Path(maxtext.__file__).parent / "configs" / "base.yml"
    train_compile.main(["train_compile", str(base), *flags])
    compiled = kept["compiled"]
    memory = compiled.memory_analysis()
    analysis = compiled.cost_analysis() or {}
    if isinstance(analysis, list):
        analysis = analysis[0]
    from importlib.metadata import version
    Path(out_dir, "hlo.txt").write_text(compiled.as_text())
    Path(out_dir, "stats.json").write_text(json.dumps({
        "arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
        "aliased": memory.alias_size_in_bytes, "temporaries": memory.temp_size_in_bytes,
        "code": memory.generated_code_size_in_bytes, "flops": analysis.get("flops", 0.0),
        "bytes": analysis.get("bytes accessed", 0.0),
        "versions": {p: version(p) for p in ("maxtext", "jax", "libtpu")}}))


def run_maxtext(python: str, flags) -> dict:
    """Compile MaxText's step in the side environment; its stats and HLO text."""
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_WORKER_HOSTNAMES="localhost",
               TPU_ACCELERATOR_TYPE=dict(f.split("=", 1) for f in flags)["compile_topology"])
    for key in ("PYTHONPATH", "TPU_LIBRARY_PATH"):   # this environment's, set by its libtpu
        env.pop(key, None)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([python, __file__, "--driver", tmp, *flags], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
            return {"error": " | ".join(tail)[-400:]}
        stats = json.loads(Path(tmp, "stats.json").read_text())
        stats["hlo"] = Path(tmp, "hlo.txt").read_text()
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--maxtext_python", default=os.environ.get(
        "MAXTEXT_PYTHON", "/tmp/maxtext-env/venv/bin/python"))
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mesh", action="append", default=[],
                   help="mesh sizes for both, e.g. 'data=2,expert=2' (repeatable; default that)")
    p.add_argument("--shape", default="moe_l", choices=list(SHAPES),
                   help="the model both compile: " + "; ".join(
                       f"{k}: {v[2]}" for k, v in SHAPES.items()))
    p.add_argument("--json", default="")
    p.add_argument("--hlo_dir", default="", help="keep each side's compiled HLO text here")
    args = p.parse_args(argv)
    if not Path(args.maxtext_python).exists():
        print(f"error: no MaxText side environment at {args.maxtext_python}: run "
              f"bash benchmarks/setup_maxtext.sh first, or pass --maxtext_python",
              file=sys.stderr)
        return 2
    from benchmarks.tpu_compile import run_row
    from dagmoe_jax.compile.chips import parse_topology
    from dagmoe_jax.compile.calibration import predict
    from dagmoe_jax.compile.roofline import program_cost
    from dagmoe_jax.run.gin import load_model_config
    from dagmoe_jax.model.accounting import account

    chip, grid = parse_topology(args.topology)
    chips = 1
    for g in grid:
        chips *= g
    from benchmarks.tpu_compile import VARIANT_BINDINGS, VARIANTS
    model, variant, _ = SHAPES[args.shape]
    cfg = load_model_config([f"models/{model}.gin", *VARIANTS[variant]],
                            ["ModelConfig.compute_dtype = 'bfloat16'",
                             *[b.replace("=", " = ", 1) for b in VARIANT_BINDINGS.get(variant, ())]])
    model_flops = account(cfg, args.seq).train_flops_per_token * args.batch * args.seq / chips
    print(f"{'who':<9}{'mesh':<24}{'GB/chip':>8}{'args':>7}{'TFLOP':>8}{'comp.TF':>8}"
          f"{'GB acc':>8}{'coll GB':>8}{'sum ms':>9}{'floor ms':>9}{'pred ms':>9}{'tok/s':>10}"
          f"{'MFU':>7}{'MT/ours':>8}",
          flush=True)
    rows = []
    for mesh_text in args.mesh or ["data=2,expert=2"]:
        mesh = parse_mesh(mesh_text)
        ours = run_row(model, variant, args.topology, args.batch, args.seq, mesh_text, [],
                       args.hlo_dir)
        flags = maxtext_flags(cfg, args.batch, args.seq, chips, mesh, args.topology)
        theirs = run_maxtext(args.maxtext_python, flags)
        if args.hlo_dir and "hlo" in theirs:
            kept = Path(args.hlo_dir, f"maxtext_{mesh_text}".replace(",", "_"))
            kept.mkdir(parents=True, exist_ok=True)
            (kept / "train.hlo.txt").write_text(theirs["hlo"])
        line = {}
        for who, r in (("dagmoe", ours), ("maxtext", theirs)):
            if "error" in r:
                print(f"{who:<9}{mesh_text:<24}  {r['error']}", flush=True)
                continue
            if who == "dagmoe":
                t = r["programs"]["train"]
                m = t["memory_per_chip"]
                row = dict(total=m["total"], args=m["arguments"],
                           tflop=t["flops_per_chip"]["roofline_matmul"],
                           comp=t["flops_per_chip"]["compiler"],
                           hbm=t["bytes_accessed_per_chip"]["roofline_hbm"],
                           coll=sum(c["bytes"] for c in t["collectives"].values()),
                           seconds=t["estimate"]["seconds"],
                           floor=t["estimate"]["overlapped_seconds"],
                           versions={"libtpu": r["libtpu"]})
            else:
                cost = program_cost(r["hlo"], chip, chips,
                                    gmm_occupancy=1.0 / max(mesh["expert"], 1))
                row = dict(total=r["arguments"] + r["temporaries"] + r["code"]
                           + max(r["outputs"] - r["aliased"], 0), args=r["arguments"],
                           tflop=cost.matmul_flops, comp=r["flops"], hbm=cost.hbm_bytes,
                           coll=sum(c["bytes"] for c in cost.collectives.values()),
                           seconds=cost.seconds, floor=cost.overlapped_seconds,
                           versions=r["versions"],
                           kernels=cost.kernels)
            pred = predict(row["floor"], chip)
            row["predicted"] = pred.seconds if pred else row["seconds"]
            line[who] = row
            tokens = args.batch * args.seq
            ratio = (f"{line['maxtext']['predicted'] / line['dagmoe']['predicted']:.3f}"
                     if who == "maxtext" and "dagmoe" in line else "")
            print(f"{who:<9}{mesh_text:<24}{row['total'] / 1e9:>8.1f}{row['args'] / 1e9:>7.1f}"
                  f"{row['tflop'] / 1e12:>8.2f}{row['comp'] / 1e12:>8.2f}{row['hbm'] / 1e9:>8.1f}"
                  f"{row['coll'] / 1e9:>8.2f}{row['seconds'] * 1e3:>9.1f}"
                  f"{row['floor'] * 1e3:>9.1f}{row['predicted'] * 1e3:>9.1f}"
                  f"{tokens / row['predicted']:>10,.0f}"
                  f"{model_flops / (row['predicted'] * chip.peak_flops):>7.1%}{ratio:>8}",
                  flush=True)
        rows.append({"mesh": mesh_text, **line})
    versions = {k: v for r in rows for who in ("dagmoe", "maxtext") if who in r
                for k, v in ((p if p == who else f"{who} {p}", x)
                             for p, x in r[who]["versions"].items())}
    print(f"{args.shape}, topology {args.topology}, batch {args.batch} x {args.seq}; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    unit = predict(1.0, chip)
    if unit:
        print(f"pred: {unit.calibration.scale:.2f} x the floor (compile/calibration.py), "
              f"calibration runs {unit.calibration.spread()}; tok/s, MFU and MT/ours from it")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--driver":
        driver(sys.argv[2], sys.argv[3:])
        sys.exit(0)
    sys.exit(main())
