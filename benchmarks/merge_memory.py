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
``dagmoe_jax/run/directory.py``). The extrapolation to four Llama 3.2 3B experts adds up what
the command holds, by formula (the merged MoE: shared weights once, N experts' MLPs, in the
merge's dtype; N domains' float64 statistics, layers x ((d+1)^2 + d+1) each; the device's
float32 Kahan sums of one domain; the largest transient, a shared parameter's float64 sum plus
one float32 tensor, or one expert tensor placed; the write, at most its bound), all as if held
at once, plus the larger size's remainder before the write (what the formula leaves
unexplained, XLA's buffers of the statistics pass) in proportion to the experts' size.

    python benchmarks/merge_memory.py                  # two sizes, float32 and bfloat16

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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from hf_import_memory import write_checkpoint  # noqa: E402

from dagmoe_jax.run.directory import INITIAL_SAVE_GB  # noqa: E402

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
    remainder = {}
    with tempfile.TemporaryDirectory() as tmp:
        for d, layers, ffn, vocab in SIZES:
            size = dict(d=d, layers=layers, ffn=ffn, vocab=vocab)
            root = Path(tmp) / f"d{d}"
            folders = [root / f"expert{j}" for j in range(args.experts)]
            experts = sum(write_checkpoint(f, d, layers, ffn, vocab) for f in folders)
            largest = experts
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
                formula = sum(predicted(size, args.experts, nbytes).values())
                remainder[dtype] = watched["before_write"] - baseline - formula
                print(f"{'':<34}{dtype:<10}{grown / 2**20:>12.0f} MiB{grown / experts:>10.2f}x"
                      f"{(watched['before_write'] - baseline) / 2**20:>10.0f} MiB"
                      f"{watched['write'] / 2**20:>6.0f} MiB{formula / 2**20:>6.0f} MiB"
                      f"{remainder[dtype] / 2**20:>7.0f} MiB", flush=True)
    print(f"\nextrapolated to {args.experts} Llama 3.2 3B experts (d 3072, 28 layers, ffn 8192, "
          f"vocabulary 128256, tied):")
    experts = shapes(**LLAMA_3B)[0] * args.experts
    print(f"  experts' summed float32 size: {experts / 1e9:.1f} GB")
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
        parts = predicted(LLAMA_3B, args.experts, nbytes)
        share = max(remainder[dtype], 0) / largest          # grows with the size: scaled
        parts["the write, bounded"] = min(parts["merged MoE"], INITIAL_SAVE_GB * 2 ** 30)
        total = sum(parts.values()) + share * experts
        shown = " + ".join(f"{v / 1e9:.1f} ({k})" for k, v in parts.items())
        print(f"  {dtype}: {shown} + {share:.2f} x {experts / 1e9:.1f} (the larger size's "
              f"remainder before the write, {share:.2f}x its experts) = {total / 1e9:.1f} GB = "
              f"{total / experts:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
