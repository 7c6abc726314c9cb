"""End to end: three dense experts on distinguishable domains -> ``python -m dagmoe_jax.upcycle``
-> a run directory that loads, routes each domain to its expert and beats averaging."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from conftest import make_model, tiny_config
from dagmoe_jax import run as run_lib
from dagmoe_jax.data import DataConfig, make_tokenizer
from dagmoe_jax.data.pipeline import eval_batches, train_dataset
from dagmoe_jax.evaluation import evaluate
from dagmoe_jax.train.step import make_train_step
from dagmoe_jax.upcycle import __main__ as cli
from dagmoe_jax.upcycle import command, dume, moerge

# Three domains with disjoint byte alphabets and their own regularities.
ALPHABETS = ("abcdefgh", "01234567", "#$%&*+=@")


def write_domain(path, alphabet, seed):
    rng = np.random.default_rng(seed)
    step = 1 + seed                                   # each domain its own cycle
    docs = []
    for _ in range(60):
        start = rng.integers(len(alphabet))
        docs.append("".join(alphabet[(start + step * i) % len(alphabet)] for i in range(60)))
    path.write_text("\n\n".join(docs) + "\n")


def ce(model, batches):
    return evaluate(model, batches)["loss"]


def test_upcycle_command_end_to_end(tmp_path, capsys):
    cfg = tiny_config("dense", vocab_size=256)
    base = DataConfig(source="text:x", seq_len=32, batch_size=8, tokenizer="byte")
    sources = []
    for j, alphabet in enumerate(ALPHABETS):
        write_domain(tmp_path / f"d{j}.txt", alphabet, j)
        sources.append(f"text:{tmp_path / f'd{j}.txt'}")
    tok = make_tokenizer(base)
    step = make_train_step()
    dense_dirs, evals = [], []
    for j, source in enumerate(sources):          # branch three experts from one seed model
        data = dataclasses.replace(base, source=source)
        model = make_model(cfg)
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        it = iter(train_dataset(data, tok))
        for _ in range(60):
            b = next(it)
            step(model, opt, {k: jnp.asarray(b[k]) for k in ("inputs", "targets", "mask")})
        dense_dirs.append(str(command.write_run(str(tmp_path / f"dense{j}"), model, cfg, data,
                                                steps=1, trainable="all")))
        evals.append(list(eval_batches(data, tok, max_batches=2)))

    out = tmp_path / "dume"
    argv = [f"--run_dir={out}", "--stats_batches=3", "--steps=5"]
    for d, s in zip(dense_dirs, sources):
        argv += [f"--dense={d}", f"--source={s}"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "router gets no gradient" in capsys.readouterr().err    # the top-1 note, one line
    assert "RunConfig.trainable = 'router_and_gates'" in (out / "resume.gin").read_text()
    merged = run_lib.load_run(out)
    assert merged.model_cfg.block.kind == "moe" and merged.model_cfg.block.router.bias
    assert (out / "resume.gin").is_file() and (out / "dume_stats" / "domain_2.npz").is_file()

    experts = [run_lib.load_run(d).model for d in dense_dirs]
    averaged = moerge.average_models(experts)
    dume_ce = [ce(merged.model, e) for e in evals]
    avg_ce = [ce(averaged, e) for e in evals]
    own_ce = [ce(m, e) for m, e in zip(experts, evals)]
    assert np.mean(dume_ce) < np.mean(avg_ce), (dume_ce, avg_ce)
    assert all(own < ce(experts[(j + 1) % 3], evals[j]) for j, own in enumerate(own_ce))
    for j, e in enumerate(evals):
        accuracy = dume.routing_accuracy(merged.model, e, j)
        assert np.all(accuracy > 0.9), (j, accuracy)

    # the merged run scores through lm-evaluation-harness like any run directory
    from dagmoe_jax.harness.cli import main as harness
    tasks = Path(__file__).resolve().parent / "harness_tasks"
    capsys.readouterr()
    assert harness([f"--run_dir={out}", "--tasks=dagmoe_mc", f"--include_path={tasks}",
                    "--limit=2", "--bootstrap_iters=0", "--mesh=none"]) == 0
    assert "acc_norm" in capsys.readouterr().out

    # bad input: one line each, exit status 2
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for argv, message in (
            ([f"--run_dir={tmp_path / 'x'}", f"--dense={dense_dirs[0]}"], "--source"),
            ([f"--run_dir={out}", f"--dense={dense_dirs[0]}", f"--source={sources[0]}"],
             "already exists and is not an empty directory"),
            ([f"--run_dir={tmp_path / 'y'}", f"--dense={dense_dirs[0]}",
              f"--source=text:{empty}"], "empty.txt"),
            ([f"--run_dir={tmp_path / 'z'}", f"--dense={dense_dirs[0]}",
              f"--source={sources[0]}", "--trainable=router"], "no gradient")):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error:") and message in err[-1], err


def test_statistics_read_prompts_as_the_authors_do(tmp_path):
    """--stats_text=prompts: each example's prompt alone (the user turn: no template, no
    answer), with the BOS the tokenizer adds, its first N tokens a row of its own, at most M
    examples; the mask counts each example's real tokens once."""
    import json

    from conftest import write_special_tokenizer

    records = [{"instruction": f"question {i}" + " more" * i, "output": "ANSWER " * 9}
               for i in range(10)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer_json = write_special_tokenizer(tmp_path / "tok", "bos_added")
    data = DataConfig(source=f"instruct:{path}", tokenizer="hf",
                      tokenizer_path=str(tokenizer_json), heldout_fraction=0.1)
    batches = command.prompt_batches(data, max_examples=6, max_tokens=20, rows=4)
    rows = [b["inputs"][r][b["mask"][r]].tolist() for b in batches for r in range(4)
            if b["mask"][r].any()]
    assert len(rows) == 6 and all(b["inputs"].shape[0] == 4 for b in batches)
    assert all(row[0] == 257 and len(row) <= 20 for row in rows)          # BOS, first 20
    texts = [bytes(row[1:]).decode() for row in rows]
    # the training records (record 0 is held out), in order
    assert texts == [(f"question {i}" + " more" * i)[:19] for i in range(1, 7)]
    assert not any("ANSWER" in t or "###" in t for t in texts)
    assert command.prompt_text("a plain document") == "a plain document"
