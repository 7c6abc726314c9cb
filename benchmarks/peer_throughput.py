"""Training-step throughput of our MoE-s against Hugging Face transformers' OLMoE, each side in
its own process.

Both sides run a full training step (forward + backward + AdamW update) of the paper's MoE-s
shape (d 512, 4 layers, 32 heads / 8 KV heads, 32 experts of hidden 256, top-4) on the same
batch of random token ids (default 8 x 512; ``batch_tokens``, its digest checked on both sides)
and vocabulary (default 256 and 32,768): ours is ``benchmarks/step_throughput.py``'s training
step (JAX, jitted, float32), theirs ``OlmoeForCausalLM`` (PyTorch eager, float32, CPU) with
``torch.optim.AdamW``. The OLMoE config is derived from our ``ModelConfig`` so the shapes match
by construction.

Each round of each side runs in a child process of its own (``--side ours|olmoe``, started by
this script, which itself never imports torch): a fresh model, a warm-up step, then the best of
``--steps`` steps. Two frameworks in one process interfere: after each step torch's OpenMP
threads spin-wait on the cores XLA's threads need (ours read 0.72x OLMoE that way, 1.21x with
OMP_WAIT_POLICY=PASSIVE). Rounds alternate (round r: ours then OLMoE for even r, OLMoE then ours
for odd r) for ``--rounds`` rounds, each side keeping its best, so machine drift hits both
alike. Reported: s/step, tokens/s, the ratio ours / OLMoE (> 1: ours is faster), and what each
side ran under: versions, allocator and thread settings as its child saw them.

    python -m benchmarks.peer_throughput                        # vocab 256 and 32,768
    python -m benchmarks.peer_throughput --vocab 256 --steps 2  # quicker
    python -m benchmarks.peer_throughput --gin_binding "ExpertConfig.dispatch = 'capacity'"
    # OLMoE's child under glibc's malloc as it comes, as a PyTorch user runs it (without it,
    # both children run under the allocator set-up of dagmoe_jax/run/allocator.py)
    python -m benchmarks.peer_throughput --olmoe_system_malloc

torch and transformers are optional dependencies of this benchmark only:

    pip install -r benchmarks/requirements-peer.txt
    # the CPU-only torch wheel is much smaller:
    pip install -r benchmarks/requirements-peer.txt \
        --extra-index-url https://download.pytorch.org/whl/cpu
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dagmoe_jax.families.moe.config import MoEConfig
from dagmoe_jax.run.allocator import allocator, configure_allocator
from dagmoe_jax.run.gin import load_execution_config, load_model_config

MODEL_GIN = ("models/s.gin", "variants/moe.gin")
FULL = dict(batch=8, seq=512, steps=3, rounds=2)
TINY = dict(batch=2, seq=32, steps=1, rounds=1)
TINY_BINDINGS = ("ModelConfig.d_model = 64", "ModelConfig.num_layers = 2",
                 "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2",
                 "ExpertConfig.num_experts = 8", "ExpertConfig.expert_hidden = 32",
                 "RouterConfig.top_k = 2")
REMAT_MEANING = {"none": "activations stored, no recomputation",
                 "full": "layers recomputed in the backward pass",
                 "dots": "matmul outputs stored, the rest recomputed"}
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "NPROC")
SIDES = ("ours", "olmoe")
INSTALL_HINT = ("benchmarks/peer_throughput.py needs torch and transformers (optional "
                "dependencies of this benchmark only): pip install -r "
                "benchmarks/requirements-peer.txt (the CPU-only torch wheel is much smaller: "
                "add --extra-index-url https://download.pytorch.org/whl/cpu)")


def peer_installed() -> bool:
    """Whether torch and transformers can be found, without importing either."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def batch_tokens(vocab: int, batch: int, seq: int) -> np.ndarray:
    """The (batch, seq + 1) int32 token ids both sides train on: inputs ``[:, :-1]``, targets
    ``[:, 1:]`` (the same draw as step_throughput.train_step's)."""
    return np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)


def digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:16]


def check_olmoe_equivalent(cfg) -> None:
    """SystemExit unless OLMoE has an equivalent of our ModelConfig ``cfg``."""
    b = cfg.block
    if not isinstance(b, MoEConfig) or b.aggregation.kind != "sum" or b.experts.num_shared:
        raise SystemExit("OLMoE has no equivalent of this config: needs block 'moe', "
                         "aggregation 'sum' and no shared experts")
    if cfg.resolved_head_dim * cfg.num_heads != cfg.d_model:
        raise SystemExit("OLMoE needs head_dim = d_model / num_heads")


def olmoe_config(transformers, cfg, seq: int):
    """The OlmoeConfig of our ModelConfig ``cfg``: same shapes, same initialiser, same RoPE."""
    check_olmoe_equivalent(cfg)
    router, experts = cfg.block.router, cfg.block.experts
    return transformers.OlmoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        intermediate_size=experts.expert_hidden, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        num_experts=experts.num_experts, num_experts_per_tok=router.top_k,
        norm_topk_prob=router.renormalize, max_position_embeddings=max(cfg.max_seq_len, seq),
        rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        output_router_logits=True, router_aux_loss_coef=router.balance_coef,
        tie_word_embeddings=False, use_cache=False, pad_token_id=None, bos_token_id=None,
        eos_token_id=None)


def thread_settings() -> dict:
    """What this process's thread pools are sized by: the CPUs it may run on, the thread
    variables set in its environment, and how many OS threads it has now."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    tasks = Path("/proc/self/task")
    return dict(cpus=cpus, env={k: os.environ[k] for k in THREAD_ENV if k in os.environ},
                os_threads=len(list(tasks.iterdir())) if tasks.is_dir() else None)


def run_ours(cfg, execution, args, tokens) -> dict:
    """One round of ours in this process: best s/step and what it ran under."""
    import jax
    import jax.numpy as jnp
    import jaxlib
    from benchmarks import step_throughput as bench
    from dagmoe_jax.model.accounting import account
    from dagmoe_jax.model.settle import describe, settle

    step, model, optimizer, _ = bench.train_step(cfg, execution, args.batch, args.seq)
    data = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    seconds = bench.time_fn(lambda: jax.block_until_ready(step(model, optimizer, data)),
                            args.steps)
    settled = settle(cfg, execution)
    threads = thread_settings()
    nproc = threads["env"].get("NPROC", "")
    # XLA's CPU client sizes its thread pools to the schedulable CPUs (NPROC overrides)
    threads["xla_threads"] = int(nproc) if nproc.isdigit() else threads["cpus"]
    if os.environ.get("XLA_FLAGS"):
        threads["env"]["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    return dict(s_per_step=seconds, params=account(cfg).total_params, threads=threads,
                versions={"jax": jax.__version__, "jaxlib": jaxlib.__version__},
                device=f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
                remat=f"'{execution.remat}' (here: {REMAT_MEANING[settled.remat]})",
                attention=f"'{execution.attention}' (here: {describe(cfg, settled, execution)})")


def run_olmoe(cfg, args, tokens) -> dict:
    """One round of OLMoE in this process, with torch AdamW (optax.adamw(1e-4)'s defaults)."""
    try:
        import torch
        import transformers
        from transformers import OlmoeConfig, OlmoeForCausalLM  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{INSTALL_HINT} ({e})")
    from benchmarks import step_throughput as bench

    torch.set_num_threads(args.torch_threads or os.cpu_count())
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(olmoe_config(transformers, cfg, args.seq)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=1e-4)
    x = torch.from_numpy(tokens.astype(np.int64))
    inputs, targets = x[:, :-1], x[:, 1:].contiguous()

    def step():  # shift_labels: the same targets as ours (labels alone are shifted by OLMoE)
        model(input_ids=inputs, labels=inputs, shift_labels=targets).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = bench.time_fn(step, args.steps)
    threads = dict(thread_settings(), torch_threads=torch.get_num_threads(),
                   torch_interop_threads=torch.get_num_interop_threads())
    return dict(s_per_step=seconds, params=sum(p.numel() for p in model.parameters()),
                threads=threads, versions={"torch": torch.__version__,
                                           "transformers": transformers.__version__},
                attn_implementation=model.config._attn_implementation,
                experts_implementation=getattr(model.config, "_experts_implementation", None))


def child_main(args) -> int:
    """``--side``: one round of one side in this process, its record written to ``--json``."""
    start = time.time()
    bindings = [*(TINY_BINDINGS if args.tiny else ()), *args.gin_binding,
                f"ModelConfig.vocab_size = {args.vocab[0]}"]
    cfg = load_model_config(MODEL_GIN, bindings)
    tokens = batch_tokens(cfg.vocab_size, args.batch, args.seq)
    if args.side == "ours":
        record = run_ours(cfg, load_execution_config(MODEL_GIN, bindings), args, tokens)
    else:
        record = run_olmoe(cfg, args, tokens)
    record.update(side=args.side, round=args.round, vocab=cfg.vocab_size, pid=os.getpid(),
                  ppid=os.getppid(), allocator=allocator(), tokens_sha256=digest(tokens),
                  torch_loaded="torch" in sys.modules,
                  start=start, end=time.time())
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def run_child(args, side: str, vocab: int, round_: int, out: Path) -> dict:
    """Start one round of ``side`` in a child process and return its record."""
    env = dict(os.environ)
    if side == "olmoe" and args.olmoe_system_malloc:  # glibc's malloc as it comes
        env.update(DAGMOE_TCMALLOC="0", DAGMOE_GLIBC_TUNE="0")
        env["LD_PRELOAD"] = " ".join(p for p in env.get("LD_PRELOAD", "").split()
                                     if "tcmalloc" not in p)
    path = out / f"{side}-{vocab}-{round_}.json"
    cmd = [sys.executable, "-m", "benchmarks.peer_throughput", "--side", side, "--json", str(path),
           "--round", str(round_), "--vocab", str(vocab), "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps),
           *(["--torch_threads", str(args.torch_threads)] if args.torch_threads else []),
           *(["--tiny"] if args.tiny else []),
           *(["--olmoe_system_malloc"] if args.olmoe_system_malloc else []),
           *[a for b in args.gin_binding for a in ("--gin_binding", b)]]
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if proc.returncode != 0 or not path.is_file():
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"the {side} child process (vocab {vocab}, round {round_}) failed "
                         f"with status {proc.returncode}: {last}")
    return json.loads(path.read_text())


def measure(args, vocab: int, out: Path) -> tuple:
    """(row, runs): the best s/step of each side over ``args.rounds`` alternating rounds at
    ``vocab``, and every child's record in the order they ran."""
    runs, best = [], {}
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            rec = run_child(args, side, vocab, r, out)
            runs.append(rec)
            if side not in best or rec["s_per_step"] < best[side]["s_per_step"]:
                best[side] = rec
            print(f"  vocab {vocab:,}, round {r}: {side} {rec['s_per_step']:.3f} s/step "
                  f"(pid {rec['pid']})", flush=True)
    if len({rec["tokens_sha256"] for rec in runs}) != 1:
        raise SystemExit(f"vocab {vocab}: the two sides trained on different token ids")
    ours, theirs, tokens = best["ours"], best["olmoe"], args.batch * args.seq
    row = dict(vocab=vocab, ours_s_per_step=ours["s_per_step"],
               ours_tok_s=tokens / ours["s_per_step"], olmoe_s_per_step=theirs["s_per_step"],
               olmoe_tok_s=tokens / theirs["s_per_step"],
               ratio=theirs["s_per_step"] / ours["s_per_step"], ours_params=ours["params"],
               olmoe_params=theirs["params"], tokens_sha256=ours["tokens_sha256"],
               attn_implementation=theirs["attn_implementation"],
               experts_implementation=theirs["experts_implementation"])
    return row, runs


def table(rows) -> str:
    lines = ["| vocab | ours s/step | ours tok/s | OLMoE s/step | OLMoE tok/s | ours / OLMoE |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['vocab']:,} | {r['ours_s_per_step']:.3f} | {r['ours_tok_s']:,.0f} | "
              f"{r['olmoe_s_per_step']:.3f} | {r['olmoe_tok_s']:,.0f} | {r['ratio']:.2f}x |"
              for r in rows]
    return "\n".join(lines)


def describe_threads(side: str, t: dict) -> str:
    pool = (f"XLA {t['xla_threads']} threads" if side == "ours" else
            f"torch {t['torch_threads']} intra-op / {t['torch_interop_threads']} inter-op")
    env = ", ".join(f"{k}={t['env'][k]}" if k in t["env"] else f"{k} unset"
                    for k in THREAD_ENV[:2])
    extra = "".join(f", {k}={v}" for k, v in t["env"].items() if k not in THREAD_ENV[:2])
    return f"{pool}; {t['cpus']} CPUs; {t['os_threads']} OS threads; {env}{extra}"


def sides(runs) -> dict:
    """Per side: its versions, and the distinct allocators and thread settings its children
    saw (one each unless something changed between rounds)."""
    out = {}
    for side in SIDES:
        recs = [r for r in runs if r["side"] == side]
        out[side] = dict(versions=recs[0]["versions"], pids=[r["pid"] for r in recs],
                         allocator=sorted({r["allocator"] for r in recs}),
                         threads=sorted({describe_threads(side, r["threads"]) for r in recs}))
    return out


def setup_table(side_info) -> str:
    lines = ["| side | versions | allocator | threads (as its child saw them) |",
             "|---|---|---|---|"]
    for side, name in zip(SIDES, ("ours", "OLMoE")):
        s = side_info[side]
        versions = ", ".join(f"{k} {v}" for k, v in s["versions"].items())
        lines.append(f"| {name} | {versions} | {' / '.join(s['allocator'])} | "
                     f"{' / '.join(s['threads'])} |")
    return "\n".join(lines)


def notes(cfg, ours, rows) -> str:
    """Parameter counts and the documented differences between the two models (``cfg``: our
    ModelConfig; ``ours``: a record of our child, with how it settled remat and attention)."""
    kv_dim = cfg.num_kv_heads * cfg.resolved_head_dim
    qk_norms = cfg.num_layers * (cfg.d_model + kv_dim)
    lines = ["parameters (ours = dagmoe_jax.model.accounting; OLMoE = sum of p.numel()):"]
    for r in rows:
        diff = r["olmoe_params"] - r["ours_params"]
        verdict = ("= its q/k RMSNorm scales" if diff == qk_norms
                   else "UNEXPECTED, not only q/k norms")
        lines.append(f"  vocab {r['vocab']:,}: ours {r['ours_params']:,}, OLMoE "
                     f"{r['olmoe_params']:,} (OLMoE - ours = {diff:,} {verdict}: "
                     f"{cfg.num_layers} x ({cfg.d_model} + {kv_dim}))")
    e = cfg.block.experts
    dispatch = (f"capacity dispatch (capacity factor {e.capacity_factor}, overflow tokens "
                "dropped)" if e.dispatch == "capacity" else f"{e.dispatch} dispatch")
    lines += ["differences by design:",
              "  OLMoE: RMSNorm on q and k, softmax router, load-balancing loss only, dropless "
              "experts, no activation recomputation (PyTorch eager)",
              f"  ours: no q/k norm, {cfg.block.router.score_fn} router, balance + z-loss, "
              f"{dispatch}, remat {ours['remat']}, attention {ours['attention']}"]
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[256, 32768])
    p.add_argument("--batch", type=int, help=f"sequences per step (default {FULL['batch']})")
    p.add_argument("--seq", type=int, help=f"tokens per sequence (default {FULL['seq']})")
    p.add_argument("--steps", type=int,
                   help=f"timed steps per round, best of (default {FULL['steps']})")
    p.add_argument("--rounds", type=int,
                   help=f"alternating rounds per vocab (default {FULL['rounds']})")
    p.add_argument("--gin_binding", action="append", default=[],
                   help="extra gin binding, repeatable (e.g. \"ExpertConfig.dispatch = "
                        "'dropless'\"); OLMoE's config follows ours")
    p.add_argument("--torch_threads", type=int,
                   help="torch intra-op threads in OLMoE's child (default: os.cpu_count())")
    p.add_argument("--tiny", action="store_true",
                   help="shrink both models and the batch (d 64, 2 layers, 8 experts top-2, "
                        "2 x 32) for tests")
    p.add_argument("--json", metavar="PATH",
                   help="also write the rows and every child's record to PATH as JSON")
    p.add_argument("--olmoe_system_malloc", action="store_true",
                   help="OLMoE's child runs under glibc's malloc as it comes, without our "
                        "allocator set-up (default: both children run under it)")
    p.add_argument("--side", choices=SIDES,
                   help="run one round of one side in this process and write its record to "
                        "--json (the benchmark starts these child processes itself)")
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)  # for the record
    args = p.parse_args(argv)
    for name, default in (TINY if args.tiny else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.side and (not args.json or len(args.vocab) != 1):
        p.error("--side needs --json and exactly one --vocab")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.side:  # one round of one side, in a child process of the parent below
        if not (args.side == "olmoe" and args.olmoe_system_malloc):
            configure_allocator()  # TCMalloc when installed (re-executes), else glibc tuned
        return child_main(args)
    if not peer_installed():
        print(INSTALL_HINT)
        return 0
    bindings = [*(TINY_BINDINGS if args.tiny else ()), *args.gin_binding]
    print(f"each side in its own process (parent pid {os.getpid()}); batch {args.batch} x "
          f"{args.seq} tokens, best of {args.steps} steps x {args.rounds} rounds\n")
    rows, runs, cfg = [], [], None
    with tempfile.TemporaryDirectory(prefix="peer_throughput_") as tmp:
        for vocab in args.vocab:
            named = [*bindings, f"ModelConfig.vocab_size = {vocab}"]
            cfg = load_model_config(MODEL_GIN, named)
            check_olmoe_equivalent(cfg)
            row, vocab_runs = measure(args, vocab, Path(tmp))
            rows.append(row)
            runs += vocab_runs
    side_info = sides(runs)
    ours = next(r for r in runs if r["side"] == "ours")
    versions = {**side_info["ours"]["versions"], **side_info["olmoe"]["versions"]}
    print(f"\nours: {ours['device']}; OLMoE: torch CPU, attention "
          f"{rows[0]['attn_implementation']}, experts {rows[0]['experts_implementation']}")
    e = cfg.block.experts
    print(f"model: d {cfg.d_model}, {cfg.num_layers} layers, {cfg.num_heads} heads / "
          f"{cfg.num_kv_heads} kv, {e.num_experts} experts of {e.expert_hidden}, "
          f"top-{cfg.block.router.top_k}\n")
    print(table(rows) + "\n")
    print(setup_table(side_info) + "\n")
    print(notes(cfg, ours, rows))
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if args.json:
        meta = dict(batch=args.batch, seq=args.seq, steps=args.steps, rounds=args.rounds,
                    gin_bindings=bindings, versions=versions, parent_pid=os.getpid(),
                    sides=side_info)
        Path(args.json).write_text(json.dumps({**meta, "rows": rows, "runs": runs},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
