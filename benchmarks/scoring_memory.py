"""Memory and time of the harness's scoring call at a 128K vocabulary: the plain call of the
code before the vocabulary-tiled scores (full [B, S, V] float32 logits, their log-softmax and
argmax: the harness's ``_token_scores`` at 7ae9da1) against today's
(:func:`dagmoe_jax.evaluation.token_scores`: the LM head a chunk of positions at a time), in
float32 and in bfloat16 compute (``DagmoeLM(dtype='bfloat16')``).

Memory is the compiled program's own account (``memory_analysis()``: arguments + outputs +
temporaries - aliased), read without running it, at the issue's shape (16 x 2048 tokens); time
is the best of a few calls at a shape this CPU runs in seconds (default 4 x 512), the variants
alternating, in one process.

    python -m benchmarks.scoring_memory                          # s model, vocab 128,256
    python -m benchmarks.scoring_memory --batch 2 --seq 64 --time_batch 1 --time_seq 32 \\
        --vocab 512 --repeats 1                                   # a quick check
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.decoding.generate import computing_in, decoding_model
from dagmoe_jax.evaluation import token_scores
from dagmoe_jax.evaluation.scoring import program_bytes
from dagmoe_jax.model import Transformer
from dagmoe_jax.run.gin import load_model_config
from dagmoe_jax.model.settle import settle


def plain_scores(graphdef, state, inputs, targets):
    """The scoring call before the tiles (7ae9da1): full logits, log-softmax, argmax."""
    logits, _ = nnx.merge(graphdef, state)(inputs)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def tiled_scores(graphdef, state, inputs, targets):
    """Today's (:mod:`dagmoe_jax.evaluation.scoring`)."""
    losses, predictions = token_scores(nnx.merge(graphdef, state), inputs, targets)
    return -losses, predictions == targets


CALLS = {"plain": plain_scores, "tiled": tiled_scores}


def model_for(args, dtype: str):
    cfg = load_model_config([args.model, args.variant], [f"ModelConfig.vocab_size = {args.vocab}",
                                                          f"ModelConfig.max_seq_len = {args.seq}"])
    model = nnx.eval_shape(lambda: Transformer(cfg, execution=settle(cfg), rngs=nnx.Rngs(0)))
    model = decoding_model(model)
    return model if dtype == "float32" else computing_in(model, dtype)


def compiled_bytes(fn, graphdef, state, batch: int, seq: int) -> int:
    """What the harness's batch_size='auto' counts (:func:`program_bytes`) for ``fn``."""
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return program_bytes(jax.jit(fn, static_argnums=0).lower(graphdef, state, ids, ids).compile())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/s.gin")
    p.add_argument("--variant", default="variants/dag_g128_l2.gin")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=16, help="rows of the memory table")
    p.add_argument("--seq", type=int, default=2048, help="tokens per row of the memory table")
    p.add_argument("--time_batch", type=int, default=4)
    p.add_argument("--time_seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    rows = {}
    for dtype in ("float32", "bfloat16"):
        abstract = model_for(args, dtype)
        graphdef, state = nnx.split(abstract)
        for name, fn in CALLS.items():
            rows[(name, dtype)] = {"bytes": compiled_bytes(fn, graphdef, state, args.batch,
                                                           args.seq)}
    # Time: real parameters at the small shape, the variants alternating.
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, args.vocab, (args.time_batch, args.time_seq)), jnp.int32)
    concrete = {}
    for dtype in ("float32", "bfloat16"):
        cfg = model_for(args, "float32").cfg
        model = decoding_model(Transformer(cfg, execution=settle(cfg), rngs=nnx.Rngs(0)))
        model = model if dtype == "float32" else computing_in(model, dtype)
        concrete[dtype] = nnx.split(model)
    jitted = {name: jax.jit(fn, static_argnums=0) for name, fn in CALLS.items()}
    for key in rows:
        graphdef, state = concrete[key[1]]
        jax.block_until_ready(jitted[key[0]](graphdef, state, tokens, tokens))  # compile
        rows[key]["times"] = []
    for r in range(args.repeats):
        for key in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
            graphdef, state = concrete[key[1]]
            start = time.perf_counter()
            jax.block_until_ready(jitted[key[0]](graphdef, state, tokens, tokens))
            rows[key]["times"].append(time.perf_counter() - start)

    base = rows[("plain", "float32")]
    print(f"device: {jax.devices()[0].device_kind}; {args.model} + {args.variant}, vocabulary "
          f"{args.vocab:,}; memory at {args.batch} x {args.seq} tokens (compiled, not run), time "
          f"at {args.time_batch} x {args.time_seq} (best of {args.repeats})\n")
    print(f"{'scoring call':<24}{'memory':>12}{'vs plain f32':>14}{'s/call':>10}"
          f"{'vs plain f32':>14}")
    for (name, dtype), row in rows.items():
        t = min(row["times"])
        print(f"{name + ' ' + dtype:<24}{row['bytes'] / 2**30:>9.2f} GiB"
              f"{row['bytes'] / base['bytes']:>13.3f}x{t:>10.3f}{t / min(base['times']):>13.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
