"""Peak host memory of MoErging four Hugging Face Llama checkpoints, against their summed size.

DUME merges N dense experts into one MoE (seed 004, sec. 2.2). ``moerge`` (in memory) loads
every model, copies each to float32 NumPy and stacks the experts before writing the MoE;
``stream`` (:func:`dagmoe_jax.upcycle.stream.moerge_hf`) builds the MoE abstractly and fills it
from the safetensors one parameter at a time. Each measurement runs in a fresh process: peak
RSS (``ru_maxrss``) minus the RSS once JAX and the library are imported; the merged MoE itself
is about the sum of the checkpoints less (N - 1) copies of the shared (non-MLP) weights.

    python benchmarks/merge_memory.py                       # four ~150 MB float32 checkpoints
    python benchmarks/merge_memory.py --d_model 1024 --ffn 2816 --vocab 16000

The checkpoints are written to a temporary directory and deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from hf_import_memory import write_checkpoint  # noqa: E402


def measure(folders, mode: str) -> dict:
    """In this (fresh) process: RSS after imports, then peak RSS after merging ``folders``."""
    import jax
    from flax import nnx

    from dagmoe_jax.run.settle import settle
    from dagmoe_jax.hf import llama as hf_llama
    from dagmoe_jax.upcycle import moerge, stream

    cfg = moerge.dume_config(stream.read_configs(folders), len(folders))
    execution = settle(cfg)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if mode == "stream":
        model = stream.moerge_hf(folders, cfg, execution=execution)
    else:
        model = moerge.moerge([hf_llama.load_hf_llama(f)[0] for f in folders], cfg,
                              execution=execution)
    merged = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "baseline": before, "peak": peak, "model_bytes": merged}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[1:], args.one[0])))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folders = [str(Path(tmp) / f"expert{j}") for j in range(args.experts)]
        size = sum(write_checkpoint(Path(f), args.d_model, args.layers, args.ffn, args.vocab)
                   for f in folders)
        print(f"{args.experts} checkpoints: {size / 2**20:.0f} MiB float32 safetensors in all "
              f"(d {args.d_model}, {args.layers} layers, ffn {args.ffn}, vocabulary "
              f"{args.vocab})\n")
        print(f"{'merge':<36}{'peak - baseline':>16}{'/ checkpoints':>15}{'merged MoE':>14}")
        for mode, label in (("stream", "stream (moerge_hf)"),
                            ("memory", "in memory (load all, then moerge)")):
            out = subprocess.run([sys.executable, __file__, "--one", mode] + folders,
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            grown = r["peak"] - r["baseline"]
            print(f"{label:<36}{grown / 2**20:>12.0f} MiB{grown / size:>14.2f}x"
                  f"{r['model_bytes'] / 2**20:>10.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
