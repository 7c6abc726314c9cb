"""The DP reasoning suite: train every variant on each DP task, score exact answers by size.

For each task (``lis``, ``edit_distance``, ``lcs``; DAG depths in
:mod:`experiments.dp_depth`), each variant (:mod:`experiments.variants`, equal
parameters) and each seed, :func:`run_suite` trains a model with the library's training loop on
that task alone (sizes ``train_sizes``, the same steps x batch x sequence length, i.e. the same
training tokens, for every variant), then scores exact-answer accuracy on fresh problems at every
size of ``sizes``: in distribution and longer than any seen in training. The problems depend
only on the task, the size and ``DataConfig.synthetic_seed``, so every model answers the same
ones. A seed changes the parameter initialisation and the data order, not the data.

Training problems are drawn independently of the scored ones; at small sizes the spaces are
small (10^4 digit strings of size 4), so some scored problems also occur in training. That is
in-distribution accuracy as usual; the longer sizes never occur in training.

Run directories are ``OUT/runs/<task>/<variant>/seed<k>``; an existing finished run is reused
(the loop resumes it and re-evaluates), so an interrupted suite continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

from dagmoe_jax.model.accounting import account
from benchmarks.experiments.dp_depth import DP_DEPTH_NOTES
from benchmarks.experiments.scoring import (baseline_by_size, eval_seq_len, model_predictor,
                                            paired_difference, score_by_size, seed_statistics)
from benchmarks.experiments.variants import LABELS, REFERENCE, VARIANTS, describe, variant_config
from dagmoe_jax.run.gin import load_configs
from dagmoe_jax.data import make_tokenizer
from dagmoe_jax.run import load_run
from dagmoe_jax.train.loop import train

BASE_GIN = "bench/reasoning.gin"
TASKS = ("lis", "edit_distance", "lcs")


@dataclasses.dataclass(frozen=True)
class ReasoningBudget:
    """What the suite trains and scores.

    tasks, variants, seeds: the grid (one run per task x variant x seed).
    steps, batch_size, seq_len: training length; every run sees steps x batch x seq_len tokens.
    train_sizes: (min, max) problem size in training (inclusive).
    sizes: problem sizes scored; those above ``train_sizes[1]`` are longer than trained.
    eval_examples: problems scored per task and size.
    dag_dim: d_g of the DAG-MoE L 2 module that sets every variant's added parameters.
    warmup_steps: learning-rate warm-up (the rest of the optimiser is the base gin file's).
    eval_dispatch: expert dispatch while scoring ('dropless' default: no capacity drops, so each
      problem's verdict is independent of the rest of its batch; see
      :func:`~experiments.scoring.model_predictor`). Training uses the model's own.
    base_gin, bindings: the base run (model trunk, optimiser) and extra gin bindings.
    """

    tasks: Tuple[str, ...] = TASKS
    variants: Tuple[str, ...] = VARIANTS
    seeds: Tuple[int, ...] = (0, 1)
    steps: int = 800
    batch_size: int = 16
    seq_len: int = 64
    train_sizes: Tuple[int, int] = (4, 12)
    sizes: Tuple[int, ...] = (4, 8, 12, 16, 20)
    eval_examples: int = 128
    dag_dim: int = 32
    warmup_steps: int = 30
    eval_dispatch: str = "dropless"
    base_gin: str = BASE_GIN
    bindings: Tuple[str, ...] = ()

    def __post_init__(self):
        for name in self.tasks:
            if name not in TASKS:
                raise ValueError(f"task {name!r} is invalid: expected one of {', '.join(TASKS)}")
        for name in self.variants:
            if name not in VARIANTS:
                raise ValueError(f"variant {name!r} is invalid: expected one of "
                                 f"{', '.join(VARIANTS)}")
        for field in ("tasks", "variants", "seeds", "sizes"):
            if not getattr(self, field):
                raise ValueError(f"ReasoningBudget.{field} is empty: give at least one")
        lo, hi = self.train_sizes
        if not 1 <= lo <= hi or min(self.sizes) < 1:
            raise ValueError(f"train_sizes={self.train_sizes} / sizes={self.sizes} are invalid: "
                             "sizes are integers >= 1 and train_sizes a pair lo <= hi")
        if self.steps < 1 or self.eval_examples < 1:
            raise ValueError("steps and eval_examples must be >= 1")

    @property
    def tokens_per_run(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    @property
    def num_synthetic(self) -> int:
        """Training problems per task: more than one pass needs (a line is >= 16 bytes)."""
        return max(2000, self.tokens_per_run // 16)

    @property
    def eval_seq_len(self) -> int:
        """Row length of the scored problems: one length for every task and size (so the eval
        step compiles once per variant), at least the training length."""
        return max(self.seq_len, eval_seq_len(self.tasks, self.sizes))


def run_configs(budget: ReasoningBudget, task: str, variant: str, seed: int, run_dir: Path):
    """The four configs of one run: the base gin file + the budget, then the variant."""

    lo, hi = budget.train_sizes
    warmup = min(budget.warmup_steps, max(budget.steps // 5, 0))
    bindings = [
        f"DataConfig.source = 'synthetic:{task}'",
        f"DataConfig.seq_len = {budget.seq_len}",
        f"DataConfig.batch_size = {budget.batch_size}",
        f"DataConfig.task_min_size = {lo}",
        f"DataConfig.task_max_size = {hi}",
        f"DataConfig.seed = {seed}",
        f"DataConfig.num_synthetic = {budget.num_synthetic}",
        f"OptimConfig.warmup_steps = {warmup}",
        f"RunConfig.steps = {budget.steps}",
        f"RunConfig.seed = {seed}",
        f"RunConfig.run_dir = '{run_dir}'",
        *budget.bindings,
    ]
    model_cfg, data_cfg, optim_cfg, run_cfg = load_configs([budget.base_gin], bindings)
    model_cfg = variant_config(model_cfg, variant, budget.dag_dim)
    if model_cfg.max_seq_len < budget.eval_seq_len:
        model_cfg = model_cfg.replace(max_seq_len=budget.eval_seq_len)
    return model_cfg, data_cfg, optim_cfg, run_cfg


def variant_table(budget: ReasoningBudget) -> Dict[str, dict]:
    """``{variant: {params, active_params, added_params, description}}`` on the base trunk
    (parameter counts from :func:`dagmoe_jax.model.accounting.account`; added = over ``moe``)."""
    base = run_configs(budget, budget.tasks[0], "moe", 0, Path("unused"))[0]
    reference = account(base, budget.seq_len).total_params
    rows = {}
    for variant in budget.variants:
        cfg = variant_config(base, variant, budget.dag_dim)
        acc = account(cfg, budget.seq_len)
        rows[variant] = {"params": acc.total_params, "active_params": acc.total_active_params,
                         "added_params": acc.total_params - reference,
                         "description": describe(cfg)}
    return rows


def train_and_score(budget: ReasoningBudget, task: str, variant: str, seed: int,
                    run_dir: Path, log: Callable[[str], None]) -> dict:
    """Train (or reuse) one run and score it at every size; a JSON-able record."""

    model_cfg, data_cfg, optim_cfg, run_cfg = run_configs(budget, task, variant, seed, run_dir)
    start = time.perf_counter()
    result = train(model_cfg, data_cfg, optim_cfg, run_cfg, progress=False,
                   log=lambda _message: None)
    train_seconds = time.perf_counter() - start
    if result.interrupted:
        raise KeyboardInterrupt(f"interrupted: {run_dir} saved; run the same command to resume")
    loaded = load_run(run_dir)
    start = time.perf_counter()
    accuracy = score_by_size(model_predictor(loaded.model, rows=budget.batch_size,
                                             dispatch=budget.eval_dispatch), data_cfg,
                             make_tokenizer(data_cfg), task, budget.sizes,
                             num_examples=budget.eval_examples, batch_size=budget.batch_size,
                             seq_len=budget.eval_seq_len)
    record = {"task": task, "variant": variant, "seed": seed, "run_dir": str(run_dir),
              "step": loaded.step, "heldout_loss": result.eval.get("loss"),
              "train_seconds": round(train_seconds, 2),
              "score_seconds": round(time.perf_counter() - start, 2),
              "accuracy": {str(n): a for n, a in accuracy.items()}}
    log(f"{task:<14}{variant:<11}seed {seed}: held-out loss {record['heldout_loss']:.4f}, exact "
        + " ".join(f"{n}:{100 * a:.0f}%" for n, a in accuracy.items())
        + f" ({train_seconds:.0f} s)")
    return record


def majority_baselines(budget: ReasoningBudget) -> Dict[str, Dict[str, float]]:
    """``{task: {size: accuracy}}`` of always answering the most common answer of the scored
    problems of that size: the floor a model that learned no computation reaches."""

    result = {}
    for task in budget.tasks:
        data_cfg = run_configs(budget, task, "moe", 0, Path("unused"))[1]
        result[task] = {str(n): a for n, a in baseline_by_size(
            data_cfg, make_tokenizer(data_cfg), task, budget.sizes,
            num_examples=budget.eval_examples, seq_len=budget.eval_seq_len).items()}
    return result


def summarize(runs: Sequence[dict]) -> Dict[str, Dict[str, Dict[str, List[float]]]]:
    """``{task: {variant: {size: [mean, std]}}}`` across the seeds of ``runs``."""
    grouped: Dict[Tuple[str, str], List[Dict[int, float]]] = {}
    for run in runs:
        acc = {int(n): a for n, a in run["accuracy"].items()}
        grouped.setdefault((run["task"], run["variant"]), []).append(acc)
    summary: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    for (task, variant), per_seed in grouped.items():
        stats = seed_statistics(per_seed)
        summary.setdefault(task, {})[variant] = {str(n): [m, s] for n, (m, s) in stats.items()}
    return summary


def run_suite(budget: ReasoningBudget, out_dir: str | Path, *,
              log: Callable[[str], None] = lambda _message: None) -> dict:
    """Train and score the whole grid; returns the results dict (see :func:`format_report`)."""
    out_dir = Path(out_dir)
    start = time.perf_counter()
    runs = []
    for task in budget.tasks:
        for variant in budget.variants:
            for seed in budget.seeds:
                run_dir = out_dir / "runs" / task / variant / f"seed{seed}"
                runs.append(train_and_score(budget, task, variant, seed, run_dir, log))
    return {"budget": dataclasses.asdict(budget),
            "majority_baseline": majority_baselines(budget),
            "tokens_per_run": budget.tokens_per_run,
            "variants": variant_table(budget),
            "dp_depth": {t: DP_DEPTH_NOTES[t] for t in budget.tasks},
            "runs": runs,
            "summary": summarize(runs),
            "seconds": round(time.perf_counter() - start, 1)}


def paired_vs_reference(results: dict) -> dict:
    """Per (task, variant other than the reference): the seed-paired difference of mean exact
    accuracy from the reference variant's (MoE), over the in-distribution sizes and over the
    longer ones (:func:`~experiments.scoring.paired_difference`). Empty without the
    reference or with one seed."""
    budget = results["budget"]
    hi = budget["train_sizes"][1]
    sizes = [int(n) for n in budget["sizes"]]
    groups = {"in_distribution": [n for n in sizes if n <= hi],
              "longer": [n for n in sizes if n > hi]}
    per_run: Dict[tuple, Dict[int, Dict[str, float]]] = {}
    for run in results["runs"]:
        acc = run["accuracy"]
        per_run.setdefault((run["task"], run["variant"]), {})[run["seed"]] = {
            g: (sum(acc[str(n)] for n in ns) / len(ns) if ns else float("nan"))
            for g, ns in groups.items()}
    out = {}
    for task in budget["tasks"]:
        ref = per_run.get((task, REFERENCE))
        if not ref or len(ref) < 2:
            continue
        for variant in budget["variants"]:
            if variant == REFERENCE or (task, variant) not in per_run:
                continue
            mine = per_run[(task, variant)]
            out[(task, variant)] = {g: paired_difference({s: v[g] for s, v in mine.items()},
                                                         {s: v[g] for s, v in ref.items()})
                                    for g in groups}
    return out


def format_report(results: dict) -> str:
    """Plain-text tables: one per task, variant x size, mean accuracy (%) +- std over seeds."""
    budget = results["budget"]
    lo, hi = budget["train_sizes"]
    sizes = [int(n) for n in budget["sizes"]]
    variants = results["variants"]
    lines = [f"exact-answer accuracy (%), mean +- std over seeds {tuple(budget['seeds'])}; "
             f"{budget['steps']} steps x {budget['batch_size']} x {budget['seq_len']} = "
             f"{results['tokens_per_run']:,} training tokens per run; trained on sizes "
             f"{lo}-{hi}, * = longer than trained; {budget['eval_examples']} problems per cell"]
    header = f"{'variant':<22}{'params':>10}{'added':>9}" + "".join(
        f"{str(n) + ('*' if n > hi else ''):>14}" for n in sizes)
    for task in budget["tasks"]:
        lines += ["", f"{task}  ({results['dp_depth'][task]})", header]
        for variant in budget["variants"]:
            cells = results["summary"].get(task, {}).get(variant, {})
            row = f"{LABELS[variant]:<22}{variants[variant]['params']:>10,}" \
                  f"{variants[variant]['added_params']:>+9,}"
            for n in sizes:
                mean, std = cells.get(str(n), [float('nan'), float('nan')])
                row += f"{100 * mean:>8.1f} ±{100 * std:>4.1f}"
            lines.append(row)
        floor = results.get("majority_baseline", {}).get(task)
        if floor:
            lines.append(f"{'(majority answer)':<41}" + "".join(
                f"{100 * floor[str(n)]:>8.1f}      " for n in sizes))
    paired = paired_vs_reference(results)
    if paired:
        lines += ["", f"accuracy minus {LABELS[REFERENCE]}'s, paired by seed (points, mean +- std); "
                  "* beyond the seed spread (paired t-test, 5%)",
                  f"{'task':<15}{'variant':<22}{'in distribution':>18}{'longer':>18}"]
        for (task, variant), cells in paired.items():
            text = [f"{100 * c['mean']:+8.1f} ±{100 * c['std']:>5.1f}{'*' if c['beyond_spread'] else ' '}"
                    for c in (cells["in_distribution"], cells["longer"])]
            lines.append(f"{task:<15}{LABELS[variant]:<22}{text[0]:>18}{text[1]:>18}")
    lines += ["", "(majority answer): always giving the most common answer of that size's problems "
              "(the accuracy of a model that learned the answer distribution but no computation)",
              "variants: " + "; ".join(f"{LABELS[v]} = {variants[v]['description']}"
                                       for v in budget["variants"])]
    return "\n".join(lines)
