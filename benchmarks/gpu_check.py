"""The GPU kernels on the device, before anything else is timed: numerics, then tiles.

    python -m benchmarks.gpu_check               # on a GPU (about 5 minutes on an H200)
    python -m benchmarks.gpu_check --quick       # the library's tiles only (accelerator.py)
    python -m benchmarks.gpu_check --interpret   # on CPU: the numerics, in the kernels'
                                                 # interpreters, at a tiny shape (about 30 s)

1. **Numerics.** Each kernel the device runs (``'mgpu'`` on Hopper, ``'triton'`` on sm80 and
   newer; both in ``--interpret``) computes the forward pass, the input gradient and the weight
   gradient of dropless dispatch's grouped matmul at a skewed routing (expert g takes a share
   of the rows proportional to 1 / (g + 1), expert 1 none, and 128 rows past ``sum(sizes)``,
   an expert-parallel buffer's padding), in bfloat16, at the MoE-s and MoE-l expert shapes
   (16 x 1,024 tokens x top-4 = 65,536 rows; d 512 x d_r 256 and d 1,024 x d_r 512; 32
   experts). Each is compared with ``jax.lax.ragged_dot`` in float32: the largest error over
   the reference's largest entry, which bfloat16 rounding keeps near 1e-2. Above
   :data:`TOLERANCE` the kernel FAILED and the exit status is 1.
2. **Tiles.** At the MoE-l shape, a handful of tile configurations of each kernel's forward and
   weight gradient are timed (best of 5, each compiled first) beside ``ragged_dot``'s XLA
   lowering and the library's own table (:mod:`dagmoe_jax.kernels.gpu_grouped_matmul`); the
   fastest is printed with its TFLOP/s, to be written into that table.

3. **The DAG module's Triton kernels** (``ExecutionConfig.dag_module='triton'``, sm80 and
   newer): one iteration's forward and its gradients (the carry, x, the six weights), and
   the first-and-last kernels' (eq. 6's gates and expert outputs in, eq. 12's sum out), in
   bfloat16 against XLA's iteration in float32 at the DAG-MoE-s and -l shapes (16,384
   tokens x K 4; d 512 x d_g 128, d 1,024 x d_g 256), the same tolerance; then, at the l
   shape, the forward + backward timed against XLA's bfloat16 iteration (best of 5), with the
   library's tiles (:func:`~dagmoe_jax.kernels.triton_dag_module.dag_tiles`) and six others,
   the fastest to be written into that function.

Every number also goes to JSON (``--json``; default ``$OUT/gpu_check.json`` where the
environment sets ``OUT``, as the lent machine does, else runs/accelerator/gpu_check.json).
``benchmarks/accelerator.py`` runs this first.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dagmoe_jax.kernels import gpu_grouped_matmul as gpu
from dagmoe_jax.kernels import mgpu_grouped_matmul as mgpu_lib
from dagmoe_jax.kernels import triton_grouped_matmul as triton_lib
from dagmoe_jax.kernels import triton_dag_module as dag_lib
from dagmoe_jax.families.moe.dag import (dag_initial_nodes, dag_node_update, dag_pair_weights,
                                         dag_readout)
from dagmoe_jax.model.settle import gpu_capability

TOLERANCE = 3e-2
"""Largest error over the reference's largest entry that bfloat16 inputs and outputs allow."""
SHAPES = {"s": (65536, 512, 256, 32), "l": (65536, 1024, 512, 32)}
"""Expert shape name -> (rows M, d_model, expert hidden d_r, experts)."""
INTERPRET_SHAPE = {"tiny": (512, 128, 128, 4)}
PADDING = 128
KERNELS = {"mgpu": gpu.mgpu_grouped_matmul, "triton": gpu.triton_grouped_matmul}


DAG_SHAPES = {"s": (16384, 4, 512, 128), "l": (16384, 4, 1024, 256)}
"""DAG module shape name -> (tokens T, nodes K, d_model, d_g)."""
DAG_INTERPRET_SHAPE = {"tiny": (64, 4, 64, 16)}


def skewed_sizes(rows: int, groups: int, padding: int) -> np.ndarray:
    """Rows per expert, proportional to 1 / (g + 1) with expert 1 empty, summing to
    ``rows - padding``."""
    share = 1.0 / (np.arange(groups) + 1.0)
    share[1] = 0.0
    sizes = np.floor(share / share.sum() * (rows - padding)).astype(np.int32)
    sizes[0] += rows - padding - sizes.sum()
    return sizes


def kernels_for(device, interpret: bool) -> list:
    """The kernels this device runs (both in the interpreters)."""
    if interpret:
        return list(KERNELS)
    capability = gpu_capability(device) or (0, 0)
    return (["mgpu"] if capability[0] == 9 else []) + (
        ["triton"] if capability >= (8, 0) else [])


def operands(shape, seed: int, scaled: bool = False):
    """(sizes, x [M, d], w [E, d, d_r], dy [M, d_r]) in bfloat16 at ``shape``, the routing
    :func:`skewed_sizes`; ``scaled``: w by 1 / sqrt(d), as an initialised layer's."""
    m, d, h, e = shape
    k = jax.random.split(jax.random.key(seed), 3)
    w = jax.random.normal(k[1], (e, d, h), jnp.float32) / (np.sqrt(d) if scaled else 1.0)
    return (jnp.asarray(skewed_sizes(m, e, PADDING)),
            jax.random.normal(k[0], (m, d), jnp.bfloat16), w.astype(jnp.bfloat16),
            jax.random.normal(k[2], (m, h), jnp.bfloat16))


def relative_error(value, reference) -> float:
    value, reference = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (value, reference))
    return float(np.max(np.abs(value - reference)) / max(np.max(np.abs(reference)), 1e-30))


def numerics(name: str, shape, interpret: bool, seed: int = 0) -> dict:
    """Forward, input and weight gradient of kernel ``name`` against float32 ragged_dot."""
    m = shape[0]
    sizes, x, w, dy = operands(shape, seed, scaled=True)
    fn = KERNELS[name]

    @jax.jit
    def kernel(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: fn(a, b, sizes, interpret=interpret), x, w)
        return (y, *vjp(dy))

    @jax.jit
    def reference(x, w, dy):
        x, w, dy = (a.astype(jnp.float32) for a in (x, w, dy))
        y, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
        return (y, *vjp(dy))

    got, want = kernel(x, w, dy), reference(x, w, dy)
    errors = {part: relative_error(a, b) for part, a, b in zip(("forward", "input_grad",
                                                                 "weight_grad"), got, want)}
    padded = float(jnp.max(jnp.abs(got[0][m - PADDING:].astype(jnp.float32))))
    return {"kernel": name, "shape": list(shape), "errors": errors, "padding_max": padded,
            "ok": all(v <= TOLERANCE for v in errors.values()) and padded == 0.0}


def dag_operands(shape, seed: int, first: bool = False):
    """(carry, x, ln_scale, ln_bias, w_down, w_edge, w_node, w_up) of one DAG iteration in
    bfloat16 (the LayerNorm's parameters float32), weights scaled as a trained layer's; the
    carry r [T, K, d], or with ``first`` eq. 6's (gates [T, K], expert outputs [T, K, d])."""
    t, k, d, g = shape
    key = jax.random.split(jax.random.key(seed), 9)
    normal = lambda i, s, scale=1.0: (jax.random.normal(key[i], s) * scale)  # noqa: E731
    carry = normal(0, (t, k, d)).astype(jnp.bfloat16)
    if first:
        carry = (jax.nn.softmax(normal(8, (t, k))).astype(jnp.bfloat16), carry)
    return (carry, normal(1, (t, d)).astype(jnp.bfloat16), 1.0 + 0.1 * normal(2, (d,)),
            0.1 * normal(3, (d,)), normal(4, (d, g), d ** -0.5).astype(jnp.bfloat16),
            normal(5, (2 * g, g), g ** -0.5).astype(jnp.bfloat16),
            normal(6, (2 * g, g), g ** -0.5).astype(jnp.bfloat16),
            normal(7, (g, d), g ** -0.5).astype(jnp.bfloat16))


def xla_dag_iteration(carry, x, ln_scale, ln_bias, w_down, w_edge, w_node, w_up, *,
                      edges: str = "all", edge_act: str = "silu", last: bool = False,
                      eps: float = 1e-5):
    """The 'xla' strategy's iteration on the carry, the function the Triton kernels compute:
    r^l = r^{l-1} + W_up sum_j m_(i,j) for the nodes r^{l-1} + x/K, r^0 from eq. 6 when
    ``carry`` is (gates, expert outputs), eq. 12's sum when ``last``."""
    if isinstance(carry, tuple):
        carry, residual = dag_initial_nodes(x, *carry)
    else:
        residual = (x / carry.shape[1]).astype(carry.dtype)[:, None, :]
    new = carry + dag_node_update(carry + residual, ln_scale, ln_bias, w_down, w_edge, w_node,
                                  w_up, edge_act, eps, edges)
    return dag_readout(new) if last else new


def kernel_dag_iteration(carry, x, ln_scale, ln_bias, w_down, w_edge, w_node, w_up, *,
                         eps: float = 1e-5, **options):
    """The Triton kernels' iteration with :func:`xla_dag_iteration`'s arguments (the pair
    weights in :func:`~dagmoe_jax.families.moe.dag.equations.dag_pair_weights`'s layout)."""
    return dag_lib.triton_dag_iteration(carry, x, ln_scale, ln_bias, w_down,
                                        dag_pair_weights(w_edge, w_node), w_up, eps=eps,
                                        **options)


def dag_step(fn):
    """The jitted forward and backward of an iteration ``fn`` (a summed loss's gradients)."""
    return jax.jit(jax.value_and_grad(
        lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2), argnums=tuple(range(8))))


def dag_numerics(shape, interpret: bool, first: bool = False) -> dict:
    """The Triton iteration in bfloat16 against XLA's in float32: forward and gradients; with
    ``first`` the kernels that build eq. 6's nodes and read eq. 12's sum out (L = 1)."""
    args = dag_operands(shape, 0, first)
    kernel = functools.partial(kernel_dag_iteration, last=first, interpret=interpret)
    exact = jax.tree.map(lambda a: a.astype(jnp.float32), args)
    reference = functools.partial(xla_dag_iteration, last=first)
    got = (jax.jit(kernel)(*args), *jax.tree.leaves(dag_step(kernel)(*args)[1]))
    want = (jax.jit(reference)(*exact), *jax.tree.leaves(dag_step(reference)(*exact)[1]))
    parts = (("forward",) + (("d_gates", "d_expert_out") if first else ("d_updates",))
             + ("d_x", "d_ln_scale", "d_ln_bias", "d_w_down", "d_w_edge", "d_w_node",
                "d_w_up"))
    errors = {part: relative_error(a, b) for part, a, b in zip(parts, got, want)}
    return {"kernel": "triton dag first+last" if first else "triton dag", "shape": list(shape),
            "errors": errors, "ok": all(v <= TOLERANCE for v in errors.values())}


def dag_times(shape, quick: bool = False) -> dict:
    """Forward + backward of one iteration, bfloat16: XLA's, and the Triton kernels with the
    library's tiles (``table``) and, unless ``quick``, a few others; the fastest named."""
    args = dag_operands(shape, 1)
    times = {"xla": best_time(dag_step(xla_dag_iteration), *args)}
    tiles = {"table": None, **({} if quick else {
        f"{rows}r c64 w{warps}": dag_lib.DagTiles(rows, 64, warps)
        for rows in (16, 32, 64) for warps in (4, 8)})}
    for label, tile in tiles.items():
        kernel = functools.partial(kernel_dag_iteration, tiles=tile)
        try:
            times[label] = best_time(dag_step(kernel), *args)
        except Exception as err:     # a tile that does not fit the registers, say
            times[label] = str(err).splitlines()[0][:120] if str(err) else repr(err)
    timed = {k: v for k, v in times.items() if isinstance(v, float) and k != "xla"}
    best = min(timed, key=timed.get) if timed else None
    return {"shape": list(shape), "times": times, "best": best,
            "best_tiles": dataclasses.asdict(tiles[best]) if best not in (None, "table")
            else best}


def best_time(fn, *args, repeats: int = 5) -> float:
    """Best wall time of ``repeats`` calls of the jitted ``fn`` (compiled first)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        tick = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - tick)
    return best


def candidates(name: str, role: str, n: int, quick: bool = False):
    """Tile configurations to time for an output of ``n`` columns: (label, blocks), the
    library's table first (None), alone when ``quick``."""
    out = [("table", None)]
    if quick:
        return out
    if name == "mgpu" and role == "forward":      # the snake visits 2 column tiles where n has
        out += [(f"{bm}x{bn}x64 s{st}", mgpu_lib.MgpuBlocks(bm, bn, 64, st,
                                                            2 if n >= 2 * bn else 1))
                for bm in (64, 128) for bn in (128, 256) for st in (2, 4)]
    elif name == "mgpu":
        out += [(f"{bm}x{bn}x{bk} s{st}", mgpu_lib.MgpuBlocks(bm, bn, bk, st, 1))
                for bm in (64, 128) for bn in (64, 128) for bk in (64, 128) for st in (2,)]
    elif role == "forward":
        out += [(f"{bm}x{bn}x{bk} w{wp}", triton_lib.TritonBlocks(bm, bn, bk, wp, 3))
                for bm in (64, 128) for bn in (64, 128) for bk in (32, 64) for wp in (8,)]
    else:
        out += [(f"{bm}x{bk}x{bn} w{wp}", triton_lib.TritonBlocks(bm, bn, bk, wp, 3))
                for bm in (32, 64) for bk in (64, 128) for bn in (64, 128) for wp in (4,)]
    return out


def product(name: str, role: str, blocks, sizes):
    """The jitted forward or weight-gradient product of kernel ``name`` with ``blocks``."""
    if name == "mgpu":
        rd, trd = mgpu_lib._mgpu_modules()
        if role == "forward":
            return jax.jit(lambda x, w: rd.ragged_dot(
                x, w, group_sizes=sizes, **(blocks or gpu.mgpu_blocks(
                    x.shape[0], x.shape[1], w.shape[2])).kwargs()))
        return jax.jit(lambda x, dy: trd.transposed_ragged_dot(
            x, dy, group_sizes=sizes, **(blocks or gpu.mgpu_weight_blocks(
                x.shape[1], dy.shape[1])).kwargs()))
    if role == "forward":
        return jax.jit(lambda x, w: triton_lib.triton_product(x, w, sizes, blocks=blocks))
    return jax.jit(lambda x, dy: triton_lib.triton_weight_grad(x, dy, sizes, blocks=blocks))


def tune(name: str, shape, quick: bool = False) -> dict:
    """Time each candidate tile of kernel ``name``'s forward and weight gradient at ``shape``
    (the library's alone when ``quick``); returns the times and the fastest of each."""
    m, d, h, e = shape
    sizes, x, w, dy = operands(shape, 1)
    result = {"kernel": name, "shape": list(shape), "flops": 2.0 * (m - PADDING) * d * h}
    for role, args in (("forward", (x, w)), ("weight_grad", (x, dy))):
        times, tiles = {}, dict(candidates(name, role, h, quick))
        for label, blocks in tiles.items():
            try:
                times[label] = best_time(product(name, role, blocks, sizes), *args)
            except Exception as err:     # a tile that does not fit shared memory, say
                times[label] = str(err).splitlines()[0][:120] if str(err) else repr(err)
        timed = {k: v for k, v in times.items() if isinstance(v, float)}
        best = min(timed, key=timed.get) if timed else None
        result[role] = {"times": times, "best": best,
                        "best_blocks": (dataclasses.asdict(tiles[best])
                                        if best not in (None, "table") else best)}
    return result


def ragged_dot_times(shape) -> dict:
    """XLA's ``ragged_dot`` (forward) and its weight gradient at ``shape``, for comparison."""
    sizes, x, w, dy = operands(shape, 1)
    dims = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
    forward = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, sizes))
    weight = jax.jit(lambda x, dy: jax.lax.ragged_dot_general(x, dy, sizes, dims))
    return {"forward": best_time(forward, x, w), "weight_grad": best_time(weight, x, dy)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interpret", action="store_true",
                   help="run the kernels in their interpreters (any backend), numerics only, "
                        "at a tiny shape")
    p.add_argument("--no_tune", action="store_true", help="numerics only")
    p.add_argument("--quick", action="store_true",
                   help="time the library's tiles only, beside XLA's (accelerator.py's first "
                        "step; the full sweep compiles some 40 kernels more)")
    p.add_argument("--json", default=None, help="where the JSON goes")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    names = kernels_for(device, args.interpret)
    if not names:
        print(f"no GPU grouped matmul runs on {device.device_kind} ({device.platform}): "
              f"use --interpret on a CPU", file=sys.stderr)
        return 2
    interpret_bwd = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11)
    report = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "interpret": args.interpret, "numerics": [], "tuning": []}
    print(f"device: {device.device_kind} ({device.platform}); kernels: {', '.join(names)}"
          f"{' (interpreted)' if args.interpret else ''}", flush=True)
    shapes = INTERPRET_SHAPE if args.interpret else SHAPES
    failed = False
    for name in names:
        for label, shape in shapes.items():
            if args.interpret and name == "mgpu" and not interpret_bwd:
                print(f"  {name} {label}: skipped (Mosaic GPU interprets its backward kernels "
                      f"from jax 0.11 on; this is {jax.__version__})")
                continue
            row = numerics(name, shape, args.interpret)
            report["numerics"].append(row)
            failed |= not row["ok"]
            print(f"  {name} {label} {tuple(shape)}: " + ", ".join(
                f"{k} {v:.2e}" for k, v in row["errors"].items())
                + f"; padding rows max {row['padding_max']:g}: "
                + ("ok" if row["ok"] else "FAILED"), flush=True)
    if not args.interpret and not args.no_tune:
        shape = SHAPES["l"]
        xla = ragged_dot_times(shape)
        report["ragged_dot"] = xla
        print(f"tiles at the l shape {shape}; ragged_dot (XLA): forward "
              f"{xla['forward'] * 1e3:.2f} ms, weight gradient {xla['weight_grad'] * 1e3:.2f} ms")
        for name in names:
            row = tune(name, shape, args.quick)
            report["tuning"].append(row)
            for role in ("forward", "weight_grad"):
                times = row[role]["times"]
                best = row[role]["best"]
                shown = ", ".join(f"{k} {v * 1e3:.2f}" if isinstance(v, float) else f"{k} -"
                                  for k, v in times.items())
                rate = f"{row['flops'] / times[best] / 1e12:.0f} TFLOP/s" if best else "none ran"
                print(f"  {name} {role} (ms): {shown}; best {best} ({rate})", flush=True)
    if args.interpret or (gpu_capability(device) or (0, 0)) >= (8, 0):
        for label, shape in (DAG_INTERPRET_SHAPE if args.interpret else DAG_SHAPES).items():
            for first in (False, True):
                row = dag_numerics(shape, args.interpret, first)
                report["numerics"].append(row)
                failed |= not row["ok"]
                print(f"  {row['kernel']} {label} {tuple(shape)}: " + ", ".join(
                    f"{k} {v:.2e}" for k, v in row["errors"].items())
                    + (": ok" if row["ok"] else ": FAILED"), flush=True)
            if not args.interpret and not args.no_tune and label == "l":
                times = dag_times(shape, args.quick)
                report.setdefault("dag_times", []).append(times)
                shown = ", ".join(f"{k} {v * 1e3:.2f}" if isinstance(v, float) else f"{k} -"
                                  for k, v in times["times"].items())
                best = times["best"]
                speed = (f"{times['times']['xla'] / times['times'][best]:.2f}x XLA's"
                         if best else "none ran")
                print(f"  DAG iteration {label}, forward + backward (ms): {shown}; best "
                      f"{best} ({speed})", flush=True)
    path = Path(args.json or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                              else "runs/accelerator/gpu_check.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
