"""The papers' pipeline in miniature: pre-train, fine-tune on instructions, score downstream.

DAG-MoE's Q3 (its Table 2) pre-trains DAG-MoE-l and MoE-l (+ shared expert) at equal
parameters, fine-tunes both on instruction data (3 epochs, constant learning rate) and scores
them on downstream benchmarks. This driver does the same at CPU scale, offline, with 3 seeds:

1. **Pre-train** each variant (default MoE, MoE + shared expert, DAG-MoE L 2, at equal added
   parameters, :mod:`experiments.variants`) on a text corpus, as the quality
   benchmark does (:func:`experiments.quality.run_configs`, the same runs).
2. **Fine-tune** each from its pre-trained run (``RunConfig.init_from``) for ``sft_epochs``
   epochs at a constant learning rate on an instruction set built offline
   (:mod:`experiments.instructions`: six exactly-answered skills in Alpaca records,
   formatted by the plain '### Instruction:' template, the loss on the responses only).
3. **Score** both runs through lm-evaluation-harness (:mod:`dagmoe_jax.harness`) on held-out
   problems of the same skills, per domain a multiple-choice task (acc) and a generation task
   (exact match), and on held-out text of the corpus (bits per byte, a rolling-loglikelihood
   task, the stand-in for Lambada's language modelling).

The table has the shape of DAG-MoE's Table 2 (a row per model, a column per task) with a row
per stage, every cell the mean and spread over seeds, and the seed-paired difference of each
variant from MoE + shared expert (the paper's baseline, MoE-l with a shared expert at equal
parameters), marked when it is inside the seed spread.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

from dagmoe_jax.data.chat import ChatEncoder
from dagmoe_jax.data.tokenizers import ByteTokenizer
from benchmarks.experiments.instructions import (DOMAINS, SKILLS, instruction_records,
                                                 write_jsonl, write_tasks)
from benchmarks.experiments.quality import QualityBudget, run_configs
from benchmarks.experiments.scoring import mean_std, paired_difference
from benchmarks.experiments.variants import LABELS
from dagmoe_jax.train.loop import train

BASE_GIN = "bench/quality.gin"
REFERENCE = "moe_shared"
ROLLING_TASK = "heldout_text"


@dataclasses.dataclass(frozen=True)
class DownstreamBudget:
    """What the pipeline trains and scores.

    source, eval_source: the pre-training corpus and its held-out text (DataConfig specs).
    variants, seeds: the grid. steps, batch_size, seq_len, dag_dim: pre-training, as the
      quality benchmark's budget. sft_records: instruction records (all six skills in turn);
      sft_epochs, sft_learning_rate: the fine-tuning recipe (constant rate, no warm-up, no
      weight decay: the DAG-MoE paper's, its rate scaled up for a 1M-parameter model).
    eval_per_skill: held-out problems per skill in each task; rolling_docs: held-out
      documents in the text task. batch_size also sets the fine-tuning batch.
    """

    source: str
    eval_source: str
    variants: Tuple[str, ...] = ("moe", "moe_shared", "dag_l2")
    seeds: Tuple[int, ...] = (0, 1, 2)
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 128
    dag_dim: int = 32
    sft_records: int = 1200
    sft_epochs: int = 3
    sft_learning_rate: float = 1e-3
    eval_per_skill: int = 24
    rolling_docs: int = 32
    base_gin: str = BASE_GIN
    bindings: Tuple[str, ...] = ()

    def __post_init__(self):
        if not self.variants or not self.seeds:
            raise ValueError("DownstreamBudget needs at least one variant and one seed")
        for name in ("steps", "batch_size", "seq_len", "sft_records", "sft_epochs",
                     "eval_per_skill", "rolling_docs"):
            if getattr(self, name) < 1:
                raise ValueError(f"DownstreamBudget.{name}={getattr(self, name)} must be >= 1")

    def quality_budget(self, variant: str, seed: int) -> QualityBudget:
        return QualityBudget(source=self.source, eval_source=self.eval_source,
                             variants=(variant,), seeds=(seed,), steps=self.steps,
                             batch_size=self.batch_size, seq_len=self.seq_len, eval_batches=8,
                             dag_dim=self.dag_dim, base_gin=self.base_gin,
                             bindings=self.bindings)


def plain_prompt(instruction: str) -> str:
    """A user turn and the response header in the plain template (what fine-tuning trains on
    and the tasks prompt with)."""
    return ChatEncoder(ByteTokenizer()).render([{"role": "user", "content": instruction}],
                                               add_generation_prompt=True)


def prepare_data(budget: DownstreamBudget, out: Path, domains=None) -> dict:
    """Write the instruction sets (all skills; and one per domain, for DUME) and the task
    folder; returns their paths and the task names by column. ``domains``: skills by domain
    (default :data:`~experiments.instructions.DOMAINS`)."""
    from dagmoe_jax.data import DataConfig  # pylint: disable=import-outside-toplevel
    from dagmoe_jax.data.splits import eval_source  # pylint: disable=import-outside-toplevel

    domains = domains or DOMAINS
    data = out / "data"
    records = instruction_records(SKILLS, budget.sft_records, seed=0)
    paths = {"all": write_jsonl(data / "sft_all.jsonl", records)}
    for domain, skills in domains.items():
        domain_records = instruction_records(skills, budget.sft_records // 2, seed=0)
        paths[domain] = write_jsonl(data / f"sft_{domain}.jsonl", domain_records)
        records = records + domain_records
    write_tasks(out / "tasks", plain_prompt, per_skill=budget.eval_per_skill, exclude=records,
                domains=domains)
    heldout = eval_source(DataConfig(source=budget.source, eval_source=budget.eval_source))
    docs = [{"text": str(heldout[i])} for i in range(min(budget.rolling_docs, len(heldout)))]
    write_jsonl(out / "tasks" / f"{ROLLING_TASK}.jsonl", docs)
    (out / "tasks" / f"{ROLLING_TASK}.yaml").write_text(ROLLING_YAML.format(
        name=ROLLING_TASK, data=(out / "tasks" / f"{ROLLING_TASK}.jsonl").resolve()))
    columns = {f"{d} {kind}": f"instruct_{d}_{kind.lower()}" for d in domains
               for kind in ("MC", "gen")}
    columns["text bpb"] = ROLLING_TASK
    return {"sft": {k: str(v) for k, v in paths.items()}, "tasks": str(out / "tasks"),
            "columns": columns}


ROLLING_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
"""

METRICS = {"MC": "acc,none", "gen": "exact_match,none", "bpb": "bits_per_byte,none"}


def finetune_configs(budget: DownstreamBudget, variant: str, seed: int, pre_dir: Path,
                     run_dir: Path, sft_path: str, model_cfg=None):
    """The configs of a fine-tuning run from ``pre_dir`` (the recipe in
    :class:`DownstreamBudget`); ``model_cfg`` defaults to the variant's."""
    cfg, data_cfg, optim_cfg, run_cfg = run_configs(budget.quality_budget(variant, seed),
                                                      variant, seed, run_dir)
    data_cfg = dataclasses.replace(data_cfg, source=f"instruct:{sft_path}", eval_source="",
                                   instruct_format="alpaca", chat_template="plain")
    optim_cfg = dataclasses.replace(optim_cfg, schedule="constant", warmup_steps=0,
                                    learning_rate=budget.sft_learning_rate, weight_decay=0.0)
    run_cfg = dataclasses.replace(run_cfg, init_from=str(pre_dir), epochs=budget.sft_epochs,
                                    eval_batches=4)
    return model_cfg or cfg, data_cfg, optim_cfg, run_cfg


def train_run(model_cfg, data_cfg, optim_cfg, run_cfg):
    """Train one run (or find it complete) quietly; an interrupt stops the benchmark."""
    result = train(model_cfg, data_cfg, optim_cfg, run_cfg, progress=False,
                   log=lambda _message: None)
    if result.interrupted:
        raise KeyboardInterrupt(f"interrupted: {run_cfg.run_dir} saved; run the same "
                                f"command to resume")
    return result


def score(run, tasks_dir: str, columns: Dict[str, str], batch_size: int = 16) -> Dict[str, float]:
    """Each column's metric for ``run`` (a run directory or a loaded run) through the harness."""
    # pylint: disable=import-outside-toplevel
    import lm_eval

    from dagmoe_jax.harness.lm import DagmoeLM
    from dagmoe_jax.harness.task_loading import task_manager

    lm = (DagmoeLM(run_dir=str(run), batch_size=batch_size, mesh="none")
          if isinstance(run, (str, Path)) else
          DagmoeLM(run=run, batch_size=batch_size, mesh="none"))
    tasks = sorted(set(columns.values()))
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, log_samples=False, bootstrap_iters=0,
        task_manager=task_manager(tasks_dir, tasks), verbosity="ERROR")["results"]
    return {column: float(results[task][METRICS[column.split()[-1]]])
            for column, task in columns.items()}


def run_pipeline(budget: DownstreamBudget, out_dir, *,
                 log: Callable[[str], None] = lambda _m: None) -> dict:
    """Pre-train, fine-tune and score every variant and seed (runs already complete are
    reused); returns the results dict (:func:`format_report` prints it)."""
    out = Path(out_dir)
    start = time.perf_counter()
    data = prepare_data(budget, out)
    records = []
    for variant in budget.variants:
        for seed in budget.seeds:
            pre_dir = out / "runs" / variant / f"seed{seed}"
            sft_dir = out / "runs" / variant / f"seed{seed}_sft"
            t0 = time.perf_counter()
            train_run(*run_configs(budget.quality_budget(variant, seed), variant, seed,
                                   pre_dir))
            train_run(*finetune_configs(budget, variant, seed, pre_dir, sft_dir,
                                        data["sft"]["all"]))
            for stage, run_dir in (("pre-trained", pre_dir), ("fine-tuned", sft_dir)):
                scores = score(run_dir, data["tasks"], data["columns"])
                records.append({"variant": variant, "seed": seed, "stage": stage,
                                "run_dir": str(run_dir), **scores})
                log(f"{variant:<11}seed {seed} {stage:<12}" + "  ".join(
                    f"{k} {v:.3f}" for k, v in scores.items()))
            log(f"{variant:<11}seed {seed}: {time.perf_counter() - t0:.0f} s")
    return {"budget": dataclasses.asdict(budget), "columns": data["columns"],
            "records": records, "seconds": round(time.perf_counter() - start, 1)}


def _cell(values: Sequence[float]) -> str:
    mean, std = mean_std(values)
    return f"{mean:.3f} ± {std:.3f}"


def paired(records: Sequence[dict], variant: str, column: str, stage: str,
           reference: str = REFERENCE) -> dict:
    """The seed-paired difference variant - reference in one column and stage
    (:func:`~experiments.scoring.paired_difference`: mean, std, seeds and whether
    it is beyond the seed spread by a paired t-test at 5%)."""
    def by_seed(name):
        return {r["seed"]: r[column] for r in records
                if r["variant"] == name and r["stage"] == stage}
    return paired_difference(by_seed(variant), by_seed(reference))


def format_report(results: dict) -> str:
    """The Table-2-shaped table and the paired differences."""
    records, columns = results["records"], list(results["columns"])
    budget = results["budget"]
    seeds = sorted({r["seed"] for r in records})
    lines = [f"Downstream pipeline in miniature ({len(seeds)} seeds; pre-training "
             f"{budget['steps']} steps x {budget['batch_size']} x {budget['seq_len']} tokens, "
             f"fine-tuning {budget['sft_epochs']} epochs over {budget['sft_records']} "
             f"instruction records at a constant {budget['sft_learning_rate']:g}); MC: acc, "
             f"gen: exact match (higher is better), text bpb: held-out bits per byte (lower):",
             "", "| model | stage | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    variants = list(dict.fromkeys(r["variant"] for r in records))
    for variant in variants:
        for stage in ("pre-trained", "fine-tuned"):
            rows = [r for r in records if r["variant"] == variant and r["stage"] == stage]
            if rows:
                lines.append(f"| {LABELS.get(variant, variant)} | {stage} | " + " | ".join(
                    _cell([r[c] for r in rows]) for c in columns) + " |")
    others = [v for v in variants if v != REFERENCE]
    if REFERENCE in variants and others:
        lines += ["", f"Seed-paired difference from {LABELS[REFERENCE]} (mean ± std over seeds; "
                      "'~': inside the seed spread, a paired t-test at 5%):", "",
                  "| model | stage | " + " | ".join(columns) + " |",
                  "|---|---|" + "---|" * len(columns)]
        for variant in others:
            for stage in ("pre-trained", "fine-tuned"):
                cells = []
                for c in columns:
                    p = paired(records, variant, c, stage)
                    cells.append("n/a" if not p["seeds"] else f"{p['mean']:+.3f} ± "
                                 f"{p['std']:.3f}{'' if p['beyond_spread'] else ' ~'}")
                lines.append(f"| {LABELS.get(variant, variant)} | {stage} | "
                             + " | ".join(cells) + " |")
    return "\n".join(lines)

