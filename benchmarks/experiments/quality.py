"""The quality benchmark: held-out perplexity of every variant at equal parameters and tokens.

Each variant of :mod:`experiments.variants` is trained with the library's training loop on
the same data for the same steps x batch x sequence length, from the same base model
(``configs/bench/quality.gin``), and scored on the same held-out text (the loop's final
evaluation: token-weighted cross-entropy, perplexity = exp of it). The result is framed as the
paper frames its s-size ablation: the improvement in perplexity over MoE *without* a shared
expert, absolute and relative, with the paper's own numbers beside ours
(:data:`PAPER_S_ABLATION`).

Run directories are ``OUT/runs/<variant>/seed<k>``; an existing finished run is reused.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dagmoe_jax.model.accounting import account
from benchmarks.experiments.scoring import mean_std, paired_difference
from benchmarks.experiments.variants import LABELS, REFERENCE, VARIANTS, describe, variant_config
from dagmoe_jax.run.gin import load_configs
from dagmoe_jax.train.loop import train

# The paper's parity baseline: every variant but MoE adds its parameters.
EQUAL_PARAMS_REFERENCE = "moe_shared"

BASE_GIN = "bench/quality.gin"

# The DAG-MoE summary's "Ablation Study" table (docs/design.md section 4): DAG-MoE-s (4 layers,
# d 512, 32 experts of d_r 256, top-4) pre-trained on 12B Pile tokens, Llama-3 tokenizer;
# improvement in held-out perplexity over standard MoE (whose eval loss is 2.7168, i.e.
# perplexity e^2.7168 = 15.13), every variant adding 393K parameters per layer except MLP
# mixing (98K, d_g 64: our 'mlp_small'; 'mlp' at the full budget has no paper number). The
# summary does not list L 1 or L 3 at equal parameters; the paper's sec. 5.2 says L 1 at d_g 64
# gains "about 0.5" (Fig. 4) with fewer parameters.
PAPER_MOE_EVAL_LOSS = 2.7168
PAPER_S_ABLATION: Dict[str, float] = {
    "moe": 0.0,
    "moe_shared": 0.433,
    "coe": 0.480,
    "dag_l2": 0.587,
    "mlp_small": -0.0838,
}
PAPER_SOURCE = ("DAG-MoE summary, Ablation Study table: DAG-MoE-s on 12B Pile "
                "tokens, MoE eval loss 2.7168 (perplexity 15.13)")


def paper_relative(variant: str) -> Optional[float]:
    """The paper's relative perplexity improvement over MoE for ``variant`` (None if absent)."""
    if variant not in PAPER_S_ABLATION:
        return None
    return PAPER_S_ABLATION[variant] / math.exp(PAPER_MOE_EVAL_LOSS)


@dataclasses.dataclass(frozen=True)
class QualityBudget:
    """What the benchmark trains and scores.

    source, eval_source: ``DataConfig`` source specs (``text:<globs>``, ``jsonl:<globs>``,
      ``tfds:<name>``, ...); an empty eval_source holds out ``DataConfig.heldout_fraction`` of
      the source's records.
    variants, seeds: the grid. steps, batch_size, seq_len: every run's training tokens.
    eval_batches: held-out batches scored (0 = all).
    dag_dim: d_g of the DAG-MoE L 2 module that sets every variant's added parameters.
    warmup_steps: learning-rate warm-up. base_gin, bindings: the base run and extra bindings
      (e.g. ``DataConfig.tokenizer = 'hf'``).
    """

    source: str
    eval_source: str = ""
    variants: Tuple[str, ...] = VARIANTS
    seeds: Tuple[int, ...] = (0,)
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 128
    eval_batches: int = 32
    dag_dim: int = 32
    warmup_steps: int = 50
    base_gin: str = BASE_GIN
    bindings: Tuple[str, ...] = ()

    def __post_init__(self):
        for name in self.variants:
            if name not in VARIANTS:
                raise ValueError(f"variant {name!r} is invalid: expected one of "
                                 f"{', '.join(VARIANTS)}")
        if not self.variants or not self.seeds:
            raise ValueError("QualityBudget needs at least one variant and one seed")
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 1 or self.eval_batches < 0:
            raise ValueError("steps, batch_size and seq_len must be >= 1, eval_batches >= 0")

    @property
    def tokens_per_run(self) -> int:
        return self.steps * self.batch_size * self.seq_len


def run_configs(budget: QualityBudget, variant: str, seed: int, run_dir: Path):
    """The four configs of one run: the base gin file + the budget, then the variant."""

    bindings = [
        f"DataConfig.source = {budget.source!r}",
        f"DataConfig.eval_source = {budget.eval_source!r}",
        f"DataConfig.seq_len = {budget.seq_len}",
        f"DataConfig.batch_size = {budget.batch_size}",
        f"DataConfig.seed = {seed}",
        f"OptimConfig.warmup_steps = {min(budget.warmup_steps, budget.steps // 5)}",
        f"RunConfig.steps = {budget.steps}",
        f"RunConfig.seed = {seed}",
        f"RunConfig.eval_batches = {budget.eval_batches}",
        f"RunConfig.run_dir = {str(run_dir)!r}",
        *budget.bindings,
    ]
    model_cfg, data_cfg, optim_cfg, run_cfg = load_configs([budget.base_gin], bindings)
    model_cfg = variant_config(model_cfg, variant, budget.dag_dim)
    if model_cfg.max_seq_len < budget.seq_len:
        model_cfg = model_cfg.replace(max_seq_len=budget.seq_len)
    return model_cfg, data_cfg, optim_cfg, run_cfg


def train_and_evaluate(budget: QualityBudget, variant: str, seed: int, run_dir: Path,
                       log: Callable[[str], None]) -> dict:
    """Train (or reuse) one run; its held-out loss and perplexity as a JSON-able record."""

    model_cfg, data_cfg, optim_cfg, run_cfg = run_configs(budget, variant, seed, run_dir)
    start = time.perf_counter()
    result = train(model_cfg, data_cfg, optim_cfg, run_cfg, progress=False,
                   log=lambda _message: None)
    if result.interrupted:
        raise KeyboardInterrupt(f"interrupted: {run_dir} saved; run the same command to resume")
    seconds = time.perf_counter() - start
    acc = account(model_cfg, budget.seq_len)
    record = {"variant": variant, "seed": seed, "run_dir": str(run_dir), "step": result.step,
              "loss": result.eval["loss"], "perplexity": result.eval["perplexity"],
              "eval_tokens": result.eval["tokens"],
              "unigram_baseline": result.eval.get("unigram_baseline"),
              "params": acc.total_params, "description": describe(model_cfg),
              "seconds": round(seconds, 1)}
    log(f"{variant:<11}seed {seed}: held-out loss {record['loss']:.4f}, perplexity "
        f"{record['perplexity']:.3f} ({seconds:.0f} s)")
    return record


def _ppl_by_seed(runs) -> Dict[int, float]:
    return {r["seed"]: r["perplexity"] for r in runs}


def summarize(runs: Sequence[dict]) -> Dict[str, dict]:
    """Per variant: params, mean +- std over seeds of loss and perplexity, and the improvement
    over the reference (MoE without shared expert), absolute and relative, from mean
    perplexities; the same improvement paired by seed over MoE and over MoE + shared expert
    (the equal-parameter baseline), with whether it is beyond the seed spread; the paper's
    numbers beside them."""
    by_variant: Dict[str, List[dict]] = {}
    for run in runs:
        by_variant.setdefault(run["variant"], []).append(run)
    summary = {}
    for variant, group in by_variant.items():
        loss = mean_std([r["loss"] for r in group])
        ppl = mean_std([r["perplexity"] for r in group])
        summary[variant] = {"params": group[0]["params"], "description": group[0]["description"],
                            "seeds": len(group), "loss": list(loss), "perplexity": list(ppl)}
    reference = summary.get(REFERENCE)
    ppl = {v: _ppl_by_seed(group) for v, group in by_variant.items()}
    for variant, row in summary.items():
        if reference is not None:
            delta = reference["perplexity"][0] - row["perplexity"][0]
            row["ppl_improvement"] = delta
            row["relative_improvement"] = delta / reference["perplexity"][0]
            row["added_params"] = row["params"] - reference["params"]
            if variant != REFERENCE:
                row["paired_improvement"] = paired_difference(ppl[REFERENCE], ppl[variant])
        if EQUAL_PARAMS_REFERENCE in by_variant and variant not in (REFERENCE,
                                                                     EQUAL_PARAMS_REFERENCE):
            row["paired_vs_shared"] = paired_difference(ppl[EQUAL_PARAMS_REFERENCE], ppl[variant])
        row["paper_ppl_improvement"] = PAPER_S_ABLATION.get(variant)
        row["paper_relative_improvement"] = paper_relative(variant)
    return summary


def compare_runs(runs_a: Sequence[dict], runs_b: Sequence[dict], name_a: str = "A",
                 name_b: str = "B") -> str:
    """A table comparing two benchmark runs variant by variant (e.g. two residual readings):
    mean perplexity of each and their seed-paired difference B - A, beyond the seed spread or
    not (paired t-test, 5%). Variants missing from either side are left out."""
    def by_seed(runs, variant):
        return _ppl_by_seed(r for r in runs if r["variant"] == variant)
    lines = [f"{'variant':<22}{name_a:>12}{name_b:>12}{'B - A (paired)':>20}{'beyond':>8}"]
    for variant in VARIANTS:
        a, b = by_seed(runs_a, variant), by_seed(runs_b, variant)
        if not a or not b:
            continue
        p = paired_difference(b, a)
        paired, beyond = _paired(p)
        lines.append(f"{LABELS[variant]:<22}{mean_std(list(a.values()))[0]:>12.3f}"
                     f"{mean_std(list(b.values()))[0]:>12.3f}{paired:>20}{beyond:>8}")
    return "\n".join(lines)


def run_benchmark(budget: QualityBudget, out_dir: str | Path, *,
                  log: Callable[[str], None] = lambda _message: None) -> dict:
    """Train and score every variant and seed; returns the results dict."""
    out_dir = Path(out_dir)
    start = time.perf_counter()
    runs = [train_and_evaluate(budget, variant, seed,
                               out_dir / "runs" / variant / f"seed{seed}", log)
            for variant in budget.variants for seed in budget.seeds]
    return {"budget": dataclasses.asdict(budget), "tokens_per_run": budget.tokens_per_run,
            "runs": runs, "summary": summarize(runs), "paper_source": PAPER_SOURCE,
            "seconds": round(time.perf_counter() - start, 1)}


def parse_tokens(text: str) -> int:
    """A token count written ``400000``, ``400K``, ``0.4M`` or ``1.6M`` (case-insensitive)."""
    scale = {"k": 1_000, "m": 1_000_000, "b": 1_000_000_000}.get(text.strip()[-1:].lower(), 1)
    number = text.strip()[:-1] if scale > 1 else text.strip()
    try:
        tokens = round(float(number) * scale)
    except ValueError:
        raise ValueError(f"token count {text!r} is invalid: write e.g. 400000, 400K or 0.4M") from None
    if tokens < 1:
        raise ValueError(f"token count {text!r} must be positive")
    return tokens


def ladder_budgets(budget: QualityBudget, tokens: Sequence[int]) -> List[QualityBudget]:
    """One budget per rung of a tokens ladder: ``budget`` with its steps set so that steps x
    batch x seq_len is the rung's token count (rounded to whole steps, at least one)."""
    per_step = budget.batch_size * budget.seq_len
    return [dataclasses.replace(budget, steps=max(1, round(n / per_step))) for n in sorted(tokens)]


def run_ladder(budgets: Sequence[QualityBudget], out_dir: str | Path, *,
               log: Callable[[str], None] = lambda _message: None) -> dict:
    """The benchmark at each rung of a tokens ladder, smallest first (all seeds of a rung
    before the next), each rung in ``OUT/tokens_<n>`` (finished runs are reused)."""
    out_dir = Path(out_dir)
    start = time.perf_counter()
    rungs = []
    for budget in budgets:
        log(f"rung {budget.tokens_per_run:,} tokens ({budget.steps} steps)")
        rungs.append(run_benchmark(budget, out_dir / f"tokens_{budget.tokens_per_run}", log=log))
    return {"ladder": rungs, "seconds": round(time.perf_counter() - start, 1)}


def ladder_gaps(rungs: Sequence[dict]) -> Dict[str, List[dict]]:
    """Per variant other than MoE, one entry per rung: the seed-paired relative perplexity gap to
    MoE in percent (positive = the variant is better), mean, std, seeds and whether it is beyond
    the seed spread; and the same paired change of that gap from the smallest rung (whether it
    *moves* with tokens, seed by seed)."""
    gaps: Dict[str, List[dict]] = {}
    first: Dict[str, Dict[int, float]] = {}
    for rung in rungs:
        runs = rung["runs"]
        moe = _ppl_by_seed(r for r in runs if r["variant"] == REFERENCE)
        for variant in rung["budget"]["variants"]:
            if variant == REFERENCE:
                continue
            ppl = _ppl_by_seed(r for r in runs if r["variant"] == variant)
            rel = {s: 100.0 * (moe[s] - ppl[s]) / moe[s] for s in sorted(set(moe) & set(ppl))}
            entry = {"tokens": rung["tokens_per_run"], **paired_difference(rel, {s: 0.0 for s in rel})}
            first.setdefault(variant, rel)
            entry["change"] = paired_difference(rel, first[variant])
            gaps.setdefault(variant, []).append(entry)
    return gaps


def _cell(mean: float, std: float, beyond: bool) -> str:
    return f"{mean:+.2f} ± {std:.2f}" + ("*" if beyond else " ")


def format_ladder(results: dict) -> str:
    """The ladder's tables: per variant and rung, the seed-paired relative gap to MoE (mean ±
    std over seeds, '*' beyond the spread), MoE's own perplexity per rung, and how each gap
    moved from the smallest rung."""
    rungs = results["ladder"]
    gaps = ladder_gaps(rungs)
    width = 19
    labels = [f"{rung['tokens_per_run'] / 1e6:.2g}M tokens" for rung in rungs]
    head = f"{'variant':<22}" + "".join(f"{label:>{width}}" for label in labels)
    moe_row = f"{'MoE perplexity':<22}"
    for rung in rungs:
        mean, std = rung["summary"].get(REFERENCE, {}).get("perplexity", (math.nan, math.nan))
        moe_row += f"{f'{mean:.3f} ± {std:.3f}':>{width}}"
    lines = ["perplexity gap to MoE by training tokens (seed-paired, % of MoE's perplexity, "
             "positive = better than MoE; mean ± std over seeds, '*' beyond the seed spread)",
             "", head, moe_row]
    for variant, entries in gaps.items():
        lines.append(f"{LABELS[variant]:<22}" + "".join(
            f"{_cell(e['mean'], e['std'], e['beyond_spread']):>{width}}" for e in entries))
    lines += ["", "change of each gap since the smallest rung (seed-paired, percentage points)",
              "", head]
    for variant, entries in gaps.items():
        cells = ["-"] + [_cell(e["change"]["mean"], e["change"]["std"],
                               e["change"]["beyond_spread"]) for e in entries[1:]]
        lines.append(f"{LABELS[variant]:<22}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def _paired(p: Optional[dict]) -> Tuple[str, str]:
    """(mean ± std, yes/no) of a :func:`paired_difference` over at least 2 seeds, else dashes."""
    if not p or p["seeds"] < 2:
        return "-", "-"
    return f"{p['mean']:+.3f} ± {p['std']:.3f}", "yes" if p["beyond_spread"] else "no"


def _signed(value: Optional[float], fmt: str, scale: float = 1.0, unit: str = "") -> str:
    if value is None:
        return "-"
    return format(value * scale if scale != 1.0 else value, fmt) + unit


def format_report(results: dict) -> str:
    """The table: variant, parameters, held-out loss and perplexity, the improvement over MoE
    (absolute, relative) and the paper's s-config improvement beside it."""
    budget, summary = results["budget"], results["summary"]
    seeds = tuple(budget["seeds"])
    lines = [f"held-out perplexity on {budget['eval_source'] or budget['source'] + ' (held-out)'}; "
             f"{budget['steps']} steps x {budget['batch_size']} x {budget['seq_len']} = "
             f"{results['tokens_per_run']:,} training tokens per run; "
             f"{'mean +- std over seeds ' + str(seeds) if len(seeds) > 1 else f'seed {seeds[0]}'}",
             "",
             f"{'variant':<22}{'params':>11}{'added':>10}{'loss':>9}{'perplexity':>18}"
             f"{'Δppl':>9}{'rel.':>8}{'paired Δ':>17}{'beyond':>8}{'vs shared':>17}{'beyond':>8}"
             f"   |{'paper Δppl':>11}{'paper rel.':>11}"]
    for variant in budget["variants"]:
        row = summary.get(variant)
        if row is None:
            continue
        ppl_mean, ppl_std = row["perplexity"]
        ppl = f"{ppl_mean:.3f}" + (f" ± {ppl_std:.3f}" if row["seeds"] > 1 else "")
        paired, beyond = _paired(row.get("paired_improvement"))
        shared, shared_beyond = _paired(row.get("paired_vs_shared"))
        lines.append(
            f"{LABELS[variant]:<22}{row['params']:>11,}{_signed(row.get('added_params'), '+,'):>10}"
            f"{row['loss'][0]:>9.4f}{ppl:>18}{_signed(row.get('ppl_improvement'), '+.3f'):>9}"
            f"{_signed(row.get('relative_improvement'), '+.2f', 100, '%'):>8}{paired:>17}{beyond:>8}"
            f"{shared:>17}{shared_beyond:>8}   |"
            f"{_signed(row['paper_ppl_improvement'], '+.3f'):>11}"
            f"{_signed(row['paper_relative_improvement'], '+.2f', 100, '%'):>11}")
    lines += ["", "Δppl, rel.: perplexity improvement over MoE without shared expert (positive = "
              "better), absolute and relative to MoE's perplexity.",
              "paired Δ: the same improvement per seed (same data order and initial seed), "
              "mean ± std; beyond: whether it is beyond the seed spread (paired t-test, 5%).",
              "vs shared: the paired improvement over MoE + shared expert, the equal-parameter "
              "baseline (positive = better than it).",
              f"paper: {results['paper_source']}; L 1 / L 3 at equal parameters are not in it.",
              "variants: " + "; ".join(f"{LABELS[v]} = {summary[v]['description']}"
                                       for v in budget["variants"] if v in summary)]
    return "\n".join(lines)
