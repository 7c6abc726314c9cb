"""DUME's reasoning setting in miniature (its Table 3, every row), offline.

The paper merges four Llama-3B instruct experts downloaded from Hugging Face into one MoE, with
the routers solved in closed form (ridge regression) from per-domain statistics of the experts'
hidden inputs, and scores the merged model against the experts on each one's benchmark. Here,
per seed:

1. a dense model is pre-trained on the corpus (the downstream pipeline's budget);
2. it is fine-tuned into **four experts**, one per domain of
   :data:`experiments.instructions.DUME_DOMAINS` (numbers: next, previous; ordering: max,
   sort; spelling: reverse, upper; counting: count, length), each **saved in Hugging Face
   Llama format** (:func:`dagmoe_jax.hf.export.export_hf`) and merged from those folders;
3. the rows of the paper's table are built from the four folders
   (:mod:`experiments.dume_table` names and formats them):

   * each expert alone, and the **oracle**: the experts' diagonal (each domain's tasks by its
     own expert) and the paper's reading, the merged model (averaged non-MLP weights) with
     every layer forced to the domain's expert (:func:`oracle_model`);
   * **parameter averaging** (:func:`dagmoe_jax.upcycle.moerge.average_models`);
   * **random routing**, top-1 (the merged model's routers left at their random
     initialisation, as ``build_dume(router='random')`` leaves them);
   * **DUME** top-1 and top-2, routers solved from the authors' statistics reading
     (:func:`dagmoe_jax.upcycle.command.prompt_batches`: each training record's prompt text
     alone, the tokenizer's BOS (the byte tokenizer has none), its first 1,024 tokens, at most
     2,048 records per domain), and DUME top-1 again from the **stream** reading
     (:func:`~dagmoe_jax.upcycle.command.domain_batches`: whole conversations rendered in the
     chat template and packed, every token counted, ``stats_batches`` batches);
   * **DUME+** (DUME top-2, then its routers trained on the four domains' mixed records),
     **BTX** (random top-2 routers, the experts frozen, the same router training) and the
     **upcycled DAG** (DUME top-2 plus a DAG aggregator, :func:`dagmoe_jax.upcycle.dume.
     upcycle_to_dag` with fan-in messages, its aggregator alone trained the same way): each a
     run directory written by :func:`~dagmoe_jax.upcycle.command.write_run` and continued by
     the training loop as ``train.py --gin_file=RUN/resume.gin`` continues it. Router
     training needs top-2: at top-1 the renormalised gate is 1 and the router gets no
     gradient. The three get the same steps and learning rate (``router_steps``,
     ``router_lr``);
4. every row is scored through lm-evaluation-harness on the four domains' held-out
   multiple-choice (acc) and generation (exact match) tasks.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, List

from dagmoe_jax.data.tokenizers import ByteTokenizer
from benchmarks.experiments.downstream import (DownstreamBudget, finetune_configs,
                                               prepare_data, score, train_run)
from benchmarks.experiments.dume_table import format_report
from benchmarks.experiments.instructions import DUME_DOMAINS
from benchmarks.experiments.quality import run_configs

__all__ = ["format_report", "oracle_model", "run_dume"]     # format_report: the driver's


def oracle_model(dense: List, averaged, expert: int):
    """The paper's Oracle for domain ``expert``: the merged model with every layer's routing
    forced to that domain's expert, i.e. the averaged non-MLP weights with dense model
    ``expert``'s MLPs (what :func:`dagmoe_jax.upcycle.dume.forced_forward` computes), as a
    dense model the harness can score."""
    # pylint: disable=import-outside-toplevel
    from flax import nnx

    from dagmoe_jax.model.params import flat_params, set_params
    from dagmoe_jax.upcycle.moerge import MLP_PREFIX

    model = nnx.clone(averaged)
    own = flat_params(dense[expert])
    set_params(model, {p: v for p, v in own.items() if p[:-1] == MLP_PREFIX})
    return model


def _in_memory(model, base):
    """A loaded-run stand-in the harness scores (a model built here, never saved)."""
    return SimpleNamespace(model=model, model_cfg=model.cfg, tokenizer=ByteTokenizer(),
                           data_cfg=base, step=0)


def _merged(models, stats, top_k, seed):
    """The four dense models merged at ``top_k``, routers solved from ``stats`` (None: left
    random)."""
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax.model.settle import settle
    from dagmoe_jax.upcycle import dume as dume_lib
    from dagmoe_jax.upcycle import moerge

    cfg = moerge.dume_config(models[0].cfg, len(models), top_k=top_k)
    moe = moerge.moerge(models, cfg, execution=settle(cfg), seed=seed)
    return moe if stats is None else dume_lib.dume(moe, stats)


def _trained(run_dir: Path, model, data_cfg, steps: int, lr: float, trainable: str,
             summary: dict) -> Path:
    """``model`` written as a run (:func:`~dagmoe_jax.upcycle.command.write_run`: step 0 and
    its resume.gin) and trained ``steps`` steps of ``trainable`` on ``data_cfg`` (the mixed
    domains) as ``train.py --gin_file=RUN/resume.gin`` would; a complete run is reused."""
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.upcycle.command import ROUTER_OPTIM, write_run

    if not (run_dir / run_lib.CHECKPOINT_DIR).exists():
        optim = dataclasses.replace(ROUTER_OPTIM, learning_rate=lr)
        write_run(str(run_dir), model, model.cfg, data_cfg, steps=steps, trainable=trainable,
                  optim_cfg=optim, summary=summary)
    train_run(*run_lib.load_configs(run_dir))
    return run_dir


def run_dume(budget: DownstreamBudget, out_dir, *, stats_batches: int = 8,
             router_steps: int = 60, router_lr: float = 1e-3,
             log: Callable[[str], None] = lambda _m: None) -> dict:
    """Steps 1-4 of the module docstring for every seed; the results dict
    (:func:`experiments.dume_table.format_report` prints it)."""
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax import run as run_lib
    from dagmoe_jax.hf import export as hf_export
    from dagmoe_jax.upcycle import dume as dume_lib
    from dagmoe_jax.upcycle import moerge
    from dagmoe_jax.upcycle.command import (STATS_DIR, build_dume, domain_batches,
                                            domain_data, load_dense, mixed_data,
                                            prompt_batches, write_run)
    from dagmoe_jax.upcycle.ridge import DomainStatistics

    out = Path(out_dir)
    start = time.perf_counter()
    data = prepare_data(budget, out / "dume", domains=DUME_DOMAINS)
    columns = {c: t for c, t in data["columns"].items() if not c.endswith("bpb")}
    domains = list(DUME_DOMAINS)
    records: List[dict] = []
    for seed in budget.seeds:
        t0, first = time.perf_counter(), len(records)
        root = out / "dume" / f"seed{seed}"
        cfg, data_cfg, optim_cfg, run_cfg = run_configs(
            budget.quality_budget("moe", seed), "moe", seed, root / "dense")
        dense_cfg = cfg.replace(block="dense")
        train_run(dense_cfg, data_cfg, optim_cfg, run_cfg)
        folders, sources = [], []
        for domain in domains:
            expert_dir = root / f"expert_{domain}"
            configs = finetune_configs(budget, "moe", seed, root / "dense", expert_dir,
                                       data["sft"][domain], model_cfg=dense_cfg)
            train_run(*configs)
            records.append({"model": f"expert {domain}", "seed": seed,
                            **score(expert_dir, data["tasks"], columns)})
            folder = root / "hf" / domain
            if not (folder / "config.json").is_file():
                hf_export.export_hf(run_lib.load_run(expert_dir).model, folder)
            folders.append(folder)
            sources.append(configs[1].source)
        base = configs[1]
        models = [load_dense(str(f)).model for f in folders]

        def add(name, run, cols=None):
            records.append({"model": name, "seed": seed,
                            **score(run, data["tasks"], cols or columns)})

        averaged = moerge.average_models(models)
        add("averaging", _in_memory(averaged, base))
        oracle = {"model": "oracle (forced)", "seed": seed}
        for j, domain in enumerate(domains):
            own = {c: t for c, t in columns.items() if c.split()[0] == domain}
            oracle.update(score(_in_memory(oracle_model(models, averaged, j), base),
                                data["tasks"], own))
        records.append(oracle)
        add("random routing k1", _in_memory(_merged(models, None, 1, seed), base))
        prompts = [lambda s=s: prompt_batches(domain_data(base, s)) for s in sources]
        stream = [lambda s=s: domain_batches(domain_data(base, s), stats_batches)
                  for s in sources]
        merged_dir = root / "dume_k1"           # the headline model, kept as a run directory
        if not (merged_dir / run_lib.CHECKPOINT_DIR).exists():
            moe, moe_cfg, stats = build_dume(models_as_sources(models), prompts, top_k=1,
                                             seed=seed)
            write_run(str(merged_dir), moe, moe_cfg, mixed_data(base, sources), steps=1,
                      stats=stats, summary={"stats_text": "prompts", "top_k": 1})
        stats = [DomainStatistics.load(merged_dir / STATS_DIR / f"domain_{j}.npz")
                 for j in range(len(domains))]
        add("DUME k1 (prompts)", merged_dir)
        _, _, stream_stats = build_dume(models_as_sources(models), stream, top_k=1, seed=seed)
        add("DUME k1 (stream)", _in_memory(_merged(models, stream_stats, 1, seed), base))
        dume_k2 = _merged(models, stats, 2, seed)
        add("DUME k2", _in_memory(dume_k2, base))
        mixed = dataclasses.replace(mixed_data(base, sources), seed=seed + 1000)
        trained = dict(steps=router_steps, lr=router_lr)
        add("DUME+", _trained(root / "dume_plus", _merged(models, stats, 2, seed), mixed,
                              trainable="router", summary={"from": "DUME k2"}, **trained))
        add("BTX", _trained(root / "btx", _merged(models, None, 2, seed), mixed,
                            trainable="router", summary={"from": "random k2"}, **trained))
        dag = dume_lib.upcycle_to_dag(dume_k2, dag_dim=budget.dag_dim, dag_iters=2, seed=seed,
                                      fan_in=True)
        add("upcycled DAG", _trained(root / "dag", dag, mixed, trainable="aggregator",
                                     summary={"from": "DUME k2", "dag_init": "fan_in"},
                                     **trained))
        for r in records[first:]:
            log(f"seed {seed} {r['model']:<18}" + "  ".join(
                f"{c} {r[c]:.3f}" for c in columns if c in r))
        log(f"seed {seed}: {time.perf_counter() - t0:.0f} s")
    return {"budget": dataclasses.asdict(budget), "columns": columns, "domains": domains,
            "records": records, "stats_batches": stats_batches, "router_steps": router_steps,
            "router_lr": router_lr, "seconds": round(time.perf_counter() - start, 1)}


def models_as_sources(models) -> list:
    """Loaded dense models as :func:`~dagmoe_jax.upcycle.command.build_dume` takes them."""
    # pylint: disable=import-outside-toplevel
    from dagmoe_jax.upcycle.command import DenseSource

    return [DenseSource(m, m.cfg, None) for m in models]
