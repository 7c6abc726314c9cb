"""A one-minute tour: build a tiny DAG-MoE, print its accounting, train it briefly.

    python -m dagmoe_jax.cli.demo [--steps 300] [--variant variants/dag_g64_l2.gin]

Trains on a built-in byte-level task (reverse a random string after a separator) so nothing is
downloaded, and prints the loss as it falls. ``train.py`` is the full training job.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dagmoe_jax.config.blocks import block_summary
from dagmoe_jax.model.accounting import account
from dagmoe_jax.command_line import (USER_ERRORS, OneLineParser, cpu_without_accelerators,
                                     report_error)
from dagmoe_jax.run.gin import load_model_config
from dagmoe_jax.model import Transformer
from dagmoe_jax.model.settle import settle
from dagmoe_jax.train.step import make_train_step
from dagmoe_jax.stopping import run_command

SEP = 0


def reversal_batch(rng: np.random.Generator, batch: int, half: int):
    """Sequences ``a SEP reverse(a)`` over bytes 1..255; the loss counts only the reversed half."""
    a = rng.integers(1, 256, (batch, half))
    seq = np.concatenate([a, np.full((batch, 1), SEP), a[:, ::-1]], axis=1)
    mask = np.zeros((batch, 2 * half), bool)
    mask[:, half:] = True
    return {"inputs": jnp.asarray(seq[:, :-1], jnp.int32), "targets": jnp.asarray(seq[:, 1:], jnp.int32),
            "mask": jnp.asarray(mask)}


def main(argv=None) -> int:
    """``python -m dagmoe_jax.cli.demo``: exit status 0 done, 2 invalid arguments or gin files (a
    one-line message)."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny.gin")
    p.add_argument("--variant", default="variants/dag_g64_l2.gin")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--half", type=int, default=12, help="length of the string to reverse")
    try:
        args = p.parse_args(argv)
        if args.steps < 1:
            raise ValueError(f"--steps={args.steps} is invalid: expected an integer >= 1")
        cfg = load_model_config([args.model, args.variant])
    except USER_ERRORS as err:
        return report_error(err)
    cpu_without_accelerators()
    print(f"model {args.model} + {args.variant}: {block_summary(cfg.block)}")
    print(account(cfg, 2 * args.half).table())
    model = Transformer(cfg, execution=settle(cfg, log=print), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3, weight_decay=0.0), wrt=nnx.Param)
    step = make_train_step()
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        metrics = step(model, optimizer, reversal_batch(rng, args.batch, args.half))
        if i == 1 or i % 25 == 0 or i == args.steps:
            print(f"step {i:4d}  loss {float(metrics['ce_loss']):.3f}  "
                  f"balance {float(metrics['balance_loss']):.3f}  "
                  f"dropped {float(jnp.mean(metrics['dropped_fraction'])):.3f}  "
                  f"{time.perf_counter() - start:6.1f}s", flush=True)
    print(f"uniform-guess loss would be {np.log(255):.3f}; devices: {jax.devices()}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
