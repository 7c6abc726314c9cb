"""Training-step throughput of our MoE-s against Hugging Face transformers' OLMoE, in one run.

Both sides run a full training step (forward + backward + AdamW update) of the paper's MoE-s
shape (d 512, 4 layers, 32 heads / 8 KV heads, 32 experts of hidden 256, top-4) on the same
batch of random token ids (default 8 x 512) and vocabulary (default 256 and 32,768): ours is
``benchmarks/step_throughput.py``'s ``step_time`` (JAX, jitted, float32), theirs
``OlmoeForCausalLM`` (PyTorch eager, float32, CPU) with ``torch.optim.AdamW``. The OLMoE config
is derived from our ``ModelConfig`` so the shapes match by construction. For each vocabulary the
two sides are timed alternately for ``--rounds`` rounds (each round: a fresh model, a warm-up
step, then the best of ``--steps`` steps), keeping the best of each side, so machine drift hits
both alike. Reported: s/step, tokens/s and the ratio ours / OLMoE (> 1: ours is faster).

    python benchmarks/peer_throughput.py                        # vocab 256 and 32,768
    python benchmarks/peer_throughput.py --vocab 256 --steps 2  # quicker
    # (--vocab 256 --steps 1 --rounds 1 took 93 s on a 2-core CPU, mostly OLMoE's steps)
    python benchmarks/peer_throughput.py --gin_binding "ExpertConfig.dispatch = 'capacity'"
    # OLMoE also under glibc's malloc as it comes, as a PyTorch user runs it (a child process
    # per round: in this process it shares the allocator set-up of dagmoe_jax/run/allocator.py)
    python benchmarks/peer_throughput.py --olmoe_system_malloc

torch and transformers are optional dependencies of this benchmark only:

    pip install -r benchmarks/requirements-peer.txt
    # the CPU-only torch wheel is much smaller:
    pip install -r benchmarks/requirements-peer.txt --extra-index-url https://download.pytorch.org/whl/cpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmarks

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dagmoe_jax.model.accounting import account  # noqa: E402
from dagmoe_jax.run.gin import load_execution_config, load_model_config  # noqa: E402
from dagmoe_jax.run.allocator import allocator, release_memory  # noqa: E402
from dagmoe_jax.run.settle import describe as describe_settled  # noqa: E402
from dagmoe_jax.run.settle import settle  # noqa: E402
import step_throughput as bench  # noqa: E402

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
INSTALL_HINT = ("benchmarks/peer_throughput.py needs torch and transformers (optional dependencies "
                "of this benchmark only): pip install -r benchmarks/requirements-peer.txt "
                "(the CPU-only torch wheel is much smaller: add "
                "--extra-index-url https://download.pytorch.org/whl/cpu)")




def import_peer():
    """(torch, transformers) or None when either cannot be imported."""
    try:
        import torch
        import transformers
        from transformers import OlmoeConfig, OlmoeForCausalLM  # noqa: F401
    except ImportError:
        return None
    return torch, transformers


def olmoe_config(transformers, cfg, seq: int):
    """The OlmoeConfig of our ModelConfig ``cfg``: same shapes, same initialiser, same RoPE."""
    if cfg.block.kind != "moe" or cfg.block.aggregation.kind != "sum" or cfg.block.experts.num_shared:
        raise SystemExit("OLMoE has no equivalent of this config: needs block 'moe', "
                         "aggregation 'sum' and no shared experts")
    if cfg.resolved_head_dim * cfg.num_heads != cfg.d_model:
        raise SystemExit("OLMoE needs head_dim = d_model / num_heads")
    return transformers.OlmoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.block.experts.expert_hidden,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, num_experts=cfg.block.experts.num_experts,
        num_experts_per_tok=cfg.block.router.top_k, norm_topk_prob=cfg.block.router.renormalize,
        max_position_embeddings=max(cfg.max_seq_len, seq), rms_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        output_router_logits=True, router_aux_loss_coef=cfg.block.router.balance_coef,
        tie_word_embeddings=False, use_cache=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def build_olmoe(peer, cfg, batch: int, seq: int):
    """(model, blocking step closure) of OLMoE with torch AdamW (optax.adamw(1e-4)'s defaults)."""
    torch, transformers = peer
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(olmoe_config(transformers, cfg, seq)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))

    def step():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, step


def olmoe_in_system_malloc(args, vocab: int) -> float:
    """Best s/step of one OLMoE round in a child process that leaves glibc's malloc as it comes
    (no TCMalloc, no tuning): how a PyTorch user runs it."""
    env = {**os.environ, "DAGMOE_TCMALLOC": "0", "DAGMOE_GLIBC_TUNE": "0"}
    env["LD_PRELOAD"] = " ".join(p for p in env.get("LD_PRELOAD", "").split() if "tcmalloc" not in p)
    cmd = [sys.executable, __file__, "--olmoe_round", "--vocab", str(vocab), "--batch",
           str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--torch_threads", str(args.torch_threads or os.cpu_count()),
           *(["--tiny"] if args.tiny else []),
           *[a for b in args.gin_binding for a in ("--gin_binding", b)]]
    out = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if out.returncode != 0:
        raise SystemExit(f"the OLMoE child process failed: {out.stderr.strip().splitlines()[-1:]}")
    return float(out.stdout.split("OLMOE_SECONDS")[-1].split()[0])


def measure(bench, peer, cfg, execution, args) -> dict:
    """Best s/step of ours (``cfg`` run as ``execution``) and of OLMoE over ``args.rounds``
    alternating rounds (and of OLMoE under the system malloc in a child process, with
    ``--olmoe_system_malloc``)."""
    ours, theirs, system = math.inf, math.inf, math.inf
    for _ in range(args.rounds):
        ours = min(ours, bench.step_time(cfg, execution, args.batch, args.seq, args.steps))
        release_memory()
        model, step = build_olmoe(peer, cfg, args.batch, args.seq)
        theirs = min(theirs, bench.time_fn(step, args.steps))
        line = f"  vocab {cfg.vocab_size}: ours {ours:.3f} s/step, OLMoE {theirs:.3f} s/step"
        if args.olmoe_system_malloc:
            system = min(system, olmoe_in_system_malloc(args, cfg.vocab_size))
            line += f", OLMoE under the system malloc {system:.3f} s/step"
        print(line, flush=True)
    tokens = args.batch * args.seq
    extra = (dict(olmoe_system_s_per_step=system, ratio_system=system / ours)
             if args.olmoe_system_malloc else {})
    return dict(vocab=cfg.vocab_size, ours_s_per_step=ours, ours_tok_s=tokens / ours,
                olmoe_s_per_step=theirs, olmoe_tok_s=tokens / theirs, ratio=theirs / ours, **extra,
                ours_params=account(cfg).total_params,
                olmoe_params=sum(p.numel() for p in model.parameters()),
                attn_implementation=model.config._attn_implementation,
                experts_implementation=getattr(model.config, "_experts_implementation", None))


def table(rows) -> str:
    system = "olmoe_system_s_per_step" in rows[0]
    lines = ["| vocab | ours s/step | ours tok/s | OLMoE s/step | OLMoE tok/s | ours / OLMoE |"
             + (" OLMoE, system malloc, s/step | ours / that |" if system else ""),
             "|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if system else "")]
    lines += [f"| {r['vocab']:,} | {r['ours_s_per_step']:.3f} | {r['ours_tok_s']:,.0f} | "
              f"{r['olmoe_s_per_step']:.3f} | {r['olmoe_tok_s']:,.0f} | {r['ratio']:.2f}x |"
              + (f" {r['olmoe_system_s_per_step']:.3f} | {r['ratio_system']:.2f}x |" if system else "")
              for r in rows]
    return "\n".join(lines)


def notes(cfg, execution, rows) -> str:
    """Parameter counts and the documented differences between the two models (ours ``cfg``
    run as ``execution``)."""
    e, kv_dim = cfg.block.experts, cfg.num_kv_heads * cfg.resolved_head_dim
    qk_norms = cfg.num_layers * (cfg.d_model + kv_dim)
    lines = ["parameters (ours = dagmoe_jax.model.accounting; OLMoE = sum of p.numel()):"]
    settled = settle(cfg, execution)
    for r in rows:
        diff = r["olmoe_params"] - r["ours_params"]
        verdict = "= its q/k RMSNorm scales" if diff == qk_norms else "UNEXPECTED, not only q/k norms"
        lines.append(f"  vocab {r['vocab']:,}: ours {r['ours_params']:,}, OLMoE {r['olmoe_params']:,} "
                     f"(OLMoE - ours = {diff:,} {verdict}: {cfg.num_layers} x ({cfg.d_model} + {kv_dim}))")
    e = cfg.block.experts
    dispatch = (f"capacity dispatch (capacity factor {e.capacity_factor}, overflow tokens dropped)"
                if e.dispatch == "capacity" else f"{e.dispatch} dispatch")
    lines += ["differences by design:",
              "  OLMoE: RMSNorm on q and k, softmax router, load-balancing loss only, dropless experts, "
              "no activation recomputation (PyTorch eager)",
              f"  ours: no q/k norm, {cfg.block.router.score_fn} router, balance + z-loss, {dispatch}, "
              f"remat '{execution.remat}' (here: {REMAT_MEANING[settled.remat]}), "
              f"attention '{execution.attention}' "
              f"(here: {describe_settled(cfg, settled, execution)})"]
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[256, 32768])
    p.add_argument("--batch", type=int, help=f"sequences per step (default {FULL['batch']})")
    p.add_argument("--seq", type=int, help=f"tokens per sequence (default {FULL['seq']})")
    p.add_argument("--steps", type=int, help=f"timed steps per round, best of (default {FULL['steps']})")
    p.add_argument("--rounds", type=int, help=f"alternating rounds per vocab (default {FULL['rounds']})")
    p.add_argument("--gin_binding", action="append", default=[],
                   help="extra gin binding for ours, repeatable (e.g. \"ExpertConfig.dispatch = 'dropless'\")")
    p.add_argument("--torch_threads", type=int, help="torch intra-op threads (default: os.cpu_count())")
    p.add_argument("--tiny", action="store_true",
                   help="shrink both models and the batch (d 64, 2 layers, 8 experts top-2, 2 x 32) for tests")
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON")
    p.add_argument("--olmoe_system_malloc", action="store_true",
                   help="also time OLMoE in a child process under glibc's malloc as it comes "
                        "(the in-process OLMoE shares our allocator set-up)")
    p.add_argument("--olmoe_round", action="store_true", help=argparse.SUPPRESS)  # the child
    args = p.parse_args(argv)
    for name, default in (TINY if args.tiny else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main(argv=None):
    args = parse_args(argv)
    peer = import_peer()
    if peer is None:
        print(INSTALL_HINT)
        return 0
    torch, transformers = peer
    torch.set_num_threads(args.torch_threads or os.cpu_count())
    bindings = [*(TINY_BINDINGS if args.tiny else ()), *args.gin_binding]
    if args.olmoe_round:  # one OLMoE round for olmoe_in_system_malloc
        cfg = load_model_config(MODEL_GIN, [*bindings, f"ModelConfig.vocab_size = {args.vocab[0]}"])
        _, step = build_olmoe(peer, cfg, args.batch, args.seq)
        print(f"OLMOE_SECONDS {bench.time_fn(step, args.steps)!r}")
        return 0
    versions = {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    print(f"ours: {jax.devices()[0].device_kind} ({jax.default_backend()}); OLMoE: torch CPU, "
          f"{torch.get_num_threads()} threads; allocator (both): {allocator()}")
    print(f"batch {args.batch} x {args.seq} tokens, best of {args.steps} steps x {args.rounds} rounds\n")
    rows, cfg, execution = [], None, None
    for vocab in args.vocab:
        named = [*bindings, f"ModelConfig.vocab_size = {vocab}"]
        cfg = load_model_config(MODEL_GIN, named)
        execution = load_execution_config(MODEL_GIN, named)
        rows.append(measure(bench, peer, cfg, execution, args))
    print(f"\nOLMoE attention: {rows[0]['attn_implementation']}, experts: {rows[0]['experts_implementation']}, "
          f"torch threads: {torch.get_num_threads()}")
    print(f"model: d {cfg.d_model}, {cfg.num_layers} layers, {cfg.num_heads} heads / {cfg.num_kv_heads} kv, "
          f"{cfg.block.experts.num_experts} experts of {cfg.block.experts.expert_hidden}, top-{cfg.block.router.top_k}\n")
    print(table(rows) + "\n")
    print(notes(cfg, execution, rows))
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if args.json:
        meta = dict(batch=args.batch, seq=args.seq, steps=args.steps, rounds=args.rounds,
                    torch_threads=torch.get_num_threads(), gin_bindings=bindings, versions=versions)
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from dagmoe_jax.run.allocator import configure_allocator
    configure_allocator()  # TCMalloc when installed, else glibc tuned (dagmoe_jax/run/allocator.py)
    sys.exit(main())
