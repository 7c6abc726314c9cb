"""Peak host memory of importing a Hugging Face Llama checkpoint, against the checkpoint's size.

The import builds the model abstractly (``nnx.eval_shape``) and places each parameter as it is
read (:func:`dagmoe_jax.hf.llama.load_hf_llama`), so it should need about the
checkpoint's size, not twice (a randomly initialised model, then the checkpoint's copy). Each
measurement runs in a fresh process: peak RSS (``ru_maxrss``) minus the RSS once JAX and the
library are imported, side by side with the previous way (a concrete model, then overwritten).

    python -m benchmarks.hf_import_memory                 # a ~340 MB float32 checkpoint
    python -m benchmarks.hf_import_memory --layers 2 --vocab 4000   # quicker

The checkpoint is written to a temporary directory and deleted afterwards.
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


def write_checkpoint(folder: Path, d: int, layers: int, ffn: int, vocab: int) -> int:
    """A random float32 Llama of these sizes (untied) in ``folder``; returns its bytes."""
    import numpy as np
    from safetensors.numpy import save_file

    heads, kv = d // 64, d // 256
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
          "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": layers,
          "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 64,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "hidden_act": "silu"}
    rng = np.random.default_rng(0)
    t = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": t(vocab, d), "lm_head.weight": t(vocab, d),
               "model.norm.weight": np.ones(d, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": t(heads * 64, d),
            p + "self_attn.k_proj.weight": t(kv * 64, d),
            p + "self_attn.v_proj.weight": t(kv * 64, d),
            p + "self_attn.o_proj.weight": t(d, heads * 64),
            p + "mlp.gate_proj.weight": t(ffn, d), p + "mlp.up_proj.weight": t(ffn, d),
            p + "mlp.down_proj.weight": t(d, ffn)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(folder / "model.safetensors"))
    return (folder / "model.safetensors").stat().st_size


def measure(folder: str, mode: str) -> dict:
    """In this (fresh) process: RSS after imports, then peak RSS after importing the model."""
    import jax  # noqa: F401
    from flax import nnx

    from dagmoe_jax.model import Transformer
    from dagmoe_jax.model.settle import settle
    from dagmoe_jax.hf import llama as hf_llama
    from dagmoe_jax.model.params import set_params

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if mode == "abstract":
        model, _ = hf_llama.load_hf_llama(folder)
    else:                                # the previous way: a random model, then overwritten
        hf = hf_llama.read_hf_config(folder)
        cfg = hf_llama.model_config_from_hf(hf)
        reader = hf_llama.SafetensorsReader(folder)
        model = Transformer(cfg, execution=settle(cfg), rngs=nnx.Rngs(0))
        set_params(model, hf_llama.hf_tensors_to_params(cfg, reader.__getitem__, False))
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "baseline": before, "peak": peak, "model_bytes": params}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--one", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*args.one)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        size = write_checkpoint(Path(tmp) / "llama", args.d_model, args.layers, args.ffn,
                                args.vocab)
        print(f"checkpoint: {size / 2**20:.0f} MiB float32 safetensors (d {args.d_model}, "
              f"{args.layers} layers, ffn {args.ffn}, vocabulary {args.vocab})\n")
        print(f"{'import':<34}{'peak - baseline':>16}{'/ checkpoint':>14}")
        for mode, label in (("abstract", "abstract model, placed as read"),
                            ("concrete", "random model, then overwritten"),
                            ("abstract", "abstract (again)")):
            out = subprocess.run([sys.executable, "-m", "benchmarks.hf_import_memory", "--one",
                                  str(Path(tmp) / "llama"), mode], capture_output=True,
                                 text=True, check=True, cwd=ROOT)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            grown = r["peak"] - r["baseline"]
            print(f"{label:<34}{grown / 2**20:>12.0f} MiB{grown / size:>13.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
