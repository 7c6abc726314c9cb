"""Peak host memory of the whole DUME upcycling command, against the experts' summed size.

Runs ``python -m dagmoe_jax.upcycle`` end to end (merge of N Hugging Face Llama checkpoints
one tensor at a time, the statistics pass over one text domain per expert, the ridge routers,
the run directory written) as a child process at top-1 with the default trainable set, in
float32 and with ``--dtype=bfloat16``, at two sizes. Its peak RSS is the child's own
(``os.wait4``'s rusage, as ``/usr/bin/time`` reads it), less the peak of a child that only
imports the library and JAX (the baseline). The promise: at most 1.3x the experts' summed
float32 size, 0.7x in bfloat16.

The child runs the command's own ``main`` with the run directory's write watched: its peak
before the write ("before write") and the write's own growth ("write": Orbax encodes the
arrays it writes, at most ``INITIAL_SAVE_GB`` GB of them at once,
``dagmoe_jax/run/directory.py``). The extrapolation to four Llama 3.2 3B experts takes what the
command holds in each phase, by formula (:func:`phases`: the merge holds the merged MoE, shared
weights once and N experts' MLPs in the merge's dtype, plus its largest transient, a shared
parameter's float64 sum plus one float32 tensor, or one stacked expert tensor read; the
statistics pass holds the merged MoE, N domains' float64 statistics, layers x ((d+1)^2 + d+1)
each, and the device's float32 Kahan sums of one domain; the write adds at most its bound),
the largest of them, plus the remainder the formula leaves unexplained before the write (XLA's
buffers, the allocator's slack): the line through the two measured sizes where it grows with
the size, else the larger of the two as a fixed cost. The sum of every part at once is
printed beside it as an upper bound.

    python -m benchmarks.merge_memory                  # two sizes, float32 and bfloat16

The checkpoints, texts and run directories are written to a temporary directory and deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.hf_import_memory import write_checkpoint
from dagmoe_jax.run.directory import INITIAL_SAVE_GB

ROOT = Path(__file__).resolve().parent.parent

SIZES = ((768, 4, 2048, 8000), (1024, 8, 2816, 16000))     # d, layers, ffn, vocabulary
LLAMA_3B = dict(d=3072, layers=28, ffn=8192, vocab=128256, heads=24, kv=8, head_dim=128,
                tied=True)                                    # Llama 3.2 3B
BASELINE = "import jax, jax.numpy as jnp; import dagmoe_jax.upcycle.command; jnp.zeros(1)"
# The command itself (its main, end to end), with the run directory's write watched: the
# process's peak RSS before it (VmHWM) and its own growth (VmHWM reset by clear_refs, then read
# after), written as JSON to the file named by the first argument.
COMMAND = """
import json, sys
from dagmoe_jax import run as run_lib
from dagmoe_jax.upcycle import __main__ as cli, command
def status(key):
    return int(open('/proc/self/status').read().split(key + ':')[1].split()[0]) * 1024
def watched(*args, save=run_lib.save_initial_checkpoint, **kwargs):
    before, at = status('VmHWM'), status('VmRSS')
    open('/proc/self/clear_refs', 'w').write('5')
    save(*args, **kwargs)
    json.dump({'before_write': before, 'at_write': at, 'write': status('VmHWM') - at},
              open(sys.argv[1], 'w'))
command.run_lib.save_initial_checkpoint = watched
sys.exit(cli.main(sys.argv[2:]))
"""


def child_peak(argv, env=None) -> int:
    """Peak RSS in bytes of the child process ``argv`` (its own rusage, not this process's)."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv[:4])} failed ({proc.returncode}): {err[-2000:]}{out}")
    return usage.ru_maxrss * 1024                      # Linux reports KiB


def write_tokenizer(path: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer.json of at most ``vocab`` tokens (the experts' vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["merging experts one tensor at a time"] * 4, trainers.BpeTrainer(
        vocab_size=min(vocab, 300), special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def shapes(d, layers, ffn, vocab, heads=None, kv=None, head_dim=64, tied=False):
    """(one expert's float32 bytes, the merged MoE's parameters less the experts' MLPs,
    one MLP's parameters, the largest shared parameter, one layer-stacked MLP tensor)."""
    heads, kv = heads or d // 64, kv or d // 256
    attn = layers * (2 * d * heads * head_dim + 2 * d * kv * head_dim + 2 * d) + d
    embed = vocab * d
    mlp = layers * 3 * d * ffn
    expert = 4 * (embed * (1 if tied else 2) + attn + mlp)         # float32 bytes
    return expert, 2 * embed + attn, mlp, embed, layers * d * ffn


def predicted(size, experts: int, dtype_bytes: int) -> dict:
    """What the command holds at its peak, by formula (module docstring), in bytes."""
    expert, shared, mlp, largest, stacked = shapes(**size)
    d, layers = size["d"], size["layers"]
    parts = {"merged MoE": (shared + experts * mlp + layers * (d + 1) * experts) * dtype_bytes,
             "statistics (float64)": experts * layers * ((d + 1) ** 2 + d + 1) * 8,
             "Kahan sums (float32)": 2 * layers * ((d + 1) ** 2 + d + 1) * 4,
             "largest transient": max(largest * 12, stacked * 8)}
    return parts


def phases(size, experts: int, dtype_bytes: int) -> dict:
    """What the command holds in each of its phases before the write, by formula, in bytes:
    the merge (the merged MoE filling up, plus its largest transient) and the statistics
    pass (the merged MoE, the float64 statistics and the device's Kahan sums). Large arrays
    are freed back to the system between them (glibc serves them by mmap), so the phases'
    transients do not add up."""
    parts = predicted(size, experts, dtype_bytes)
    return {"merge": parts["merged MoE"] + parts["largest transient"],
            "statistics": parts["merged MoE"] + parts["statistics (float64)"]
                          + parts["Kahan sums (float32)"]}


def extrapolated_remainder(points, size: float) -> float:
    """The remainder at experts' size ``size`` from the measured (size, remainder) ``points``:
    the line through them where it rises, else the largest measured (a remainder that does
    not grow with the size is a fixed cost)."""
    (s1, r1), (s2, r2) = sorted(points)[-2:]
    slope = (r2 - r1) / (s2 - s1)
    return r2 + slope * (size - s2) if slope > 0 else max(r1, r2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=4)
    args = p.parse_args(argv)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    baseline = child_peak([sys.executable, "-c", BASELINE], env)
    print(f"baseline (a child importing jax and dagmoe_jax.upcycle): {baseline / 2**20:.0f} "
          f"MiB peak RSS\n")
    print(f"{'size':<34}{'dtype':<10}{'peak - baseline':>16}{'/ experts':>11}"
          f"{'before write':>14}{'write':>10}{'formula':>10}{'remainder':>11}")
    remainder = {"float32": [], "bfloat16": []}
    writes = {"float32": 0, "bfloat16": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for d, layers, ffn, vocab in SIZES:
            size = dict(d=d, layers=layers, ffn=ffn, vocab=vocab)
            root = Path(tmp) / f"d{d}"
            folders = [root / f"expert{j}" for j in range(args.experts)]
            experts = sum(write_checkpoint(f, d, layers, ffn, vocab) for f in folders)
            tokenizer = write_tokenizer(root / "tok" / "tokenizer.json", vocab)
            command = [f"--tokenizer_path={tokenizer}", "--stats_text=stream",
                       "--stats_batches=2", "--seq_len=256", "--batch_size=4", "--steps=10"]
            for j, folder in enumerate(folders):
                text = root / f"domain{j}.txt"
                text.write_text(f"domain {j} text, merged one tensor at a time. " * 2000)
                command += [f"--dense={folder}", f"--source=text:{text}"]
            print(f"{args.experts} x (d {d}, {layers} layers, ffn {ffn}, vocab {vocab}): "
                  f"{experts / 2**20:.0f} MiB", flush=True)
            for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
                stages = root / f"{dtype}.json"
                peak = child_peak([sys.executable, "-c", COMMAND, str(stages), *command,
                                   f"--run_dir={root / dtype}", f"--dtype={dtype}"], env)
                watched = json.loads(stages.read_text())
                # resetting VmHWM resets the rusage peak too: the command's peak is the larger
                # of the peak before the write and the one since
                grown = max(peak, watched["before_write"]) - baseline
                formula = max(phases(size, args.experts, nbytes).values())
                left = watched["before_write"] - baseline - formula
                remainder[dtype].append((experts, left))
                writes[dtype] = watched["write"]          # the larger size's, last
                print(f"{'':<34}{dtype:<10}{grown / 2**20:>12.0f} MiB{grown / experts:>10.2f}x"
                      f"{(watched['before_write'] - baseline) / 2**20:>10.0f} MiB"
                      f"{watched['write'] / 2**20:>6.0f} MiB{formula / 2**20:>6.0f} MiB"
                      f"{left / 2**20:>7.0f} MiB", flush=True)
    print(f"\nextrapolated to {args.experts} Llama 3.2 3B experts (d 3072, 28 layers, ffn 8192, "
          f"vocabulary 128256, tied):")
    experts = shapes(**LLAMA_3B)[0] * args.experts
    print(f"  experts' summed float32 size: {experts / 1e9:.1f} GB")
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
        parts = predicted(LLAMA_3B, args.experts, nbytes)
        phase = phases(LLAMA_3B, args.experts, nbytes)
        # at most the bound's worth of arrays in flight, plus what the larger size measured
        # beyond it (Orbax's own buffers)
        write = min(parts["merged MoE"], max(INITIAL_SAVE_GB * 2 ** 30, writes[dtype]))
        left = max(extrapolated_remainder(remainder[dtype], experts), 0)
        total = max(phase["merge"], phase["statistics"] + write) + left
        every = sum(parts.values()) + write + left
        print(f"  {dtype}: merge {phase['merge'] / 1e9:.1f} GB (the merged MoE "
              f"{parts['merged MoE'] / 1e9:.1f} + largest transient "
              f"{parts['largest transient'] / 1e9:.1f}); statistics "
              f"{phase['statistics'] / 1e9:.1f} GB (+ float64 statistics "
              f"{parts['statistics (float64)'] / 1e9:.1f} + Kahan sums "
              f"{parts['Kahan sums (float32)'] / 1e9:.1f}) + the write, bounded, "
              f"{write / 1e9:.1f}; remainder {left / 1e9:.1f} GB")
        print(f"    peak = max(merge, statistics + write) + remainder = {total / 1e9:.1f} GB = "
              f"{total / experts:.2f}x   (every part at once: {every / 1e9:.1f} GB = "
              f"{every / experts:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
