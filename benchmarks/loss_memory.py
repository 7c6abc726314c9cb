"""Peak memory and step time of the training step with the plain and the vocabulary-tiled loss,
with and without donating the training state to the step.

The plain loss projects every position to the vocabulary at once ([B, S, V] float32 logits,
then ``optax.softmax_cross_entropy_with_integer_labels``: the loss of the code before
``dagmoe_jax/model/tiled_loss.py``); the tiled loss applies the LM head a chunk of positions at
a time. ``plain`` and ``tiled`` keep the old parameters and moments alive until the step's new
ones are written (the code before); ``tiled_donated`` (the training loop's,
``make_train_step(donate=True)``) lets XLA write them in place. Each variant runs in its own process under ``/usr/bin/time -v``
(the peak resident set size of a process cannot be reset), one after the other, and the table
compares them side by side: peak RSS, the best wall time of a step and the best CPU time of a
step (user + system of all threads; less sensitive than wall time to other jobs on a shared
machine).

    python -m benchmarks.loss_memory                 # s model, vocab 128,256, batch 8 x 512
    python -m benchmarks.loss_memory --vocab 256 --batch 2 --seq 64 --steps 1   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time


VARIANTS = ("plain", "tiled", "tiled_donated")


def run_one(args) -> None:
    """Time ``args.steps`` training steps of one variant in this process; print one JSON line."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from dagmoe_jax.run.gin import load_execution_config, load_model_config
    from dagmoe_jax.model import Transformer
    from dagmoe_jax.model.settle import settle
    from dagmoe_jax.train.step import cross_entropy, lm_loss, make_train_step

    def plain_loss(model, batch):
        logits, aux = model(batch["inputs"])
        mask = jnp.ones_like(batch["targets"], dtype=bool)
        ce = cross_entropy(logits, batch["targets"], mask)
        return ce + aux["aux_loss"], {"ce_loss": ce}

    files, bindings = [args.model, args.variant_gin], [f"ModelConfig.vocab_size = {args.vocab}"]
    cfg = load_model_config(files, bindings)
    execution = settle(cfg, load_execution_config(files, bindings))
    model = Transformer(cfg, execution=execution, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    step = make_train_step(plain_loss if args.one == "plain" else lm_loss,
                           donate=args.one == "tiled_donated")
    rows = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1))
    tokens = jnp.asarray(rows, jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    t = time.perf_counter()
    first = jax.block_until_ready(step(model, optimizer, batch))
    compile_s = time.perf_counter() - t
    times, cpu = [], []
    for _ in range(args.steps):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(step(model, optimizer, batch))
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    print(json.dumps({"variant": args.one, "step_s": min(times), "cpu_s": min(cpu),
                      "first_s": compile_s, "ce_loss": float(first["ce_loss"])}))


def measure(variant: str, args) -> dict:
    """Run one variant in a child process under /usr/bin/time -v: its JSON line + peak RSS."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "benchmarks.loss_memory", "--one", variant,
           "--model", args.model, "--variant_gin", args.variant_gin, "--vocab", str(args.vocab),
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    result["peak_gb"] = rss_kb * 1024 / 1e9
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/s.gin", help="model-size gin file")
    p.add_argument("--variant_gin", default="variants/moe.gin", help="block variant gin file")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first (best of)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    if args.one:
        return run_one(args)

    print(f"{args.model} + {args.variant_gin}, vocab {args.vocab:,}, batch {args.batch} x "
          f"{args.seq}, best of {args.steps} steps; each variant a process of its own, in turn",
          flush=True)
    results = {}
    for v in args.variants:
        results[v] = measure(v, args)
        print(f"  measured {v}: {results[v]}", flush=True)
    base = results.get("plain")
    print(f"\n{'loss':<14}{'peak RSS GB':>12}{'s/step':>9}{'CPU s/step':>12}{'first step s':>14}"
          f"{'ce_loss':>10}{'peak vs plain':>15}{'step vs plain':>15}{'CPU vs plain':>14}")
    for v, r in results.items():
        ratio = (lambda key: f"{r[key] / base[key]:.3f}x") if base else (lambda key: "-")
        print(f"{v:<14}{r['peak_gb']:>12.2f}{r['step_s']:>9.3f}{r['cpu_s']:>12.2f}"
              f"{r['first_s']:>14.1f}{r['ce_loss']:>10.4f}{ratio('peak_gb'):>15}"
              f"{ratio('step_s'):>15}{ratio('cpu_s'):>14}")


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # the allocator step_throughput.py uses (dagmoe_jax/run/allocator.py)
    main()
