"""Every plot that applies to one run directory: which ones, from what, and why one is skipped.

:func:`analyze_run` loads a run's newest checkpoint, traces it over a dataset
(:func:`dagmoe_jax.analysis.collection.collect`) and writes the PNGs of
:mod:`dagmoe_jax.analysis.plots` that apply to its block type and ``summary.json`` (the
numbers: edge-gate sparsity per layer and iteration for DAG-MoE); it returns one
:class:`PlotResult` per file, written or skipped with a one-line reason. The command line is
``dagmoe-analyze`` (:mod:`dagmoe_jax.cli.analyze`, which opens the run).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import numpy as np

from dagmoe_jax.analysis import plots
from dagmoe_jax.analysis.collection import Collected, collect
from dagmoe_jax.config import family_of
from dagmoe_jax.run.paths import as_path, is_remote
from dagmoe_jax.data import eval_batches, parse_source
from dagmoe_jax.run.records import read_metrics

if TYPE_CHECKING:
    from dagmoe_jax.run.directory import LoadedRun

# The plots of routed blocks (MoE, CoE; a family with its own analysis skips them), then the
# training curves every run has. A family's own analysis adds its plots (DoE's ``PLOTS``).
ROUTED_PLOTS = ("expert_load", "coactivation", "edge_gates", "edge_gate_hist",
                "dropped_fraction", "load_balance")
PLOTS = (*ROUTED_PLOTS, "training_curves")


@dataclasses.dataclass(frozen=True)
class PlotResult:
    """name: one of :data:`PLOTS` or of a family's own analysis (DoE's ``PLOTS``); path: the
    PNG written, or None if skipped (then ``reason``)."""

    name: str
    path: Optional[Path]
    reason: str = ""


def analysis_batches(data_cfg, tokenizer, data: str = "", max_batches: int = 4,
                     annotate=None) -> list:
    """The batches to trace: the run's own held-out data, or ``data`` (a ``DataConfig``
    source spec such as ``text:notes/*.txt``, ``synthetic:lcs`` or ``tfds:name``, read with
    the run's tokenizer; a TFDS spec uses the run's ``eval_split`` or ``split``) instead."""

    if data:
        tfds = parse_source(data, "eval_source")[0] == "tfds"
        data_cfg = data_cfg.replace(eval_source=data,
                                    eval_split=data_cfg.eval_split if tfds else "")
    return eval_batches(data_cfg, tokenizer, max_batches=max_batches, annotate=annotate)


def dropped_series(records: List[dict]):
    """(steps, fractions [records, layers]) of the training records that log
    ``dropped_fraction``; (None, None) when there are none."""
    rows = [(r["step"], r["dropped_fraction"]) for r in records
            if "dropped_fraction" in r and isinstance(r["dropped_fraction"], list)]
    if not rows:
        return None, None
    rows.sort(key=lambda row: row[0])
    return [s for s, _ in rows], np.asarray([f for _, f in rows], np.float64)


def load_series(records: List[dict]):
    """(steps, loads [records, layers, N]) of the training records that log a routed block's
    ``expert_load`` (a [layers, N] list, N > 0); (None, None) when there are none."""
    rows = sorted((r["step"], r["expert_load"]) for r in records
                  if isinstance(r.get("expert_load"), list) and r["expert_load"]
                  and isinstance(r["expert_load"][0], list) and r["expert_load"][0])
    if not rows:
        return None, None
    return [s for s, _ in rows], np.asarray([load for _, load in rows], np.float64)


def curve_series(records: List[dict]):
    """(steps, loss, learning_rate, eval_steps, eval_loss) of a run's metric records, each
    sorted by step (the training records that log a loss and a learning rate; the evaluation
    records); None when no training record has both."""
    train = sorted((r["step"], r["loss"], r["learning_rate"]) for r in records
                   if isinstance(r.get("loss"), (int, float))
                   and isinstance(r.get("learning_rate"), (int, float)))
    if not train:
        return None
    evals = sorted((r["step"], r["eval/loss"]) for r in records
                   if isinstance(r.get("eval/loss"), (int, float)))
    steps, loss, lr = (list(column) for column in zip(*train))
    eval_steps = [s for s, _ in evals]
    return steps, np.asarray(loss), np.asarray(lr), eval_steps, np.asarray([v for _, v in evals])


def summary(stats: Collected) -> dict:
    """The statistics worth reading as numbers (``summary.json``): tokens, block, aggregation
    and, for a DAG model, the edge-gate sparsity per layer and iteration (:class:`Collected`)."""
    out = {"tokens": stats.tokens, "block": stats.block, "aggregation": stats.aggregation}
    if stats.gate_sparsity is not None:
        out["edge_gates"] = {"threshold": stats.sparsity_threshold,
                             "gate_sparsity": np.round(stats.gate_sparsity, 6).tolist(),
                             "pair_sparsity": np.round(stats.pair_sparsity, 6).tolist()}
    return out


def summary_lines(blob: dict) -> List[str]:
    """``summary.json`` as the lines ``dagmoe-analyze`` prints."""
    gates = blob.get("edge_gates")
    if not gates:
        return []
    lines = [f"edge-gate sparsity over {blob['tokens']:,} tokens: share of gate values "
             f"|e_(i,j)| < {gates['threshold']:g} / of node pairs with mean |e| below it"]
    for layer, (values, pairs) in enumerate(zip(gates["gate_sparsity"], gates["pair_sparsity"])):
        cells = ", ".join(f"iteration {it + 1} {v:.3f} / {p:.3f}"
                          for it, (v, p) in enumerate(zip(values, pairs)))
        lines.append(f"  layer {layer}: {cells}")
    return lines


def write_summary(stats: Collected, out_dir) -> PlotResult:
    """``summary.json`` (:func:`summary`) in ``out_dir``."""
    path = Path(out_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary(stats), indent=1) + "\n")
    return PlotResult("summary", path)


def write_plots(stats: Collected, records: List[dict], out_dir, label: str = "") -> List[PlotResult]:
    """The PNGs that apply to ``stats`` (from :func:`collect`) and the run's metric
    ``records``, written to ``out_dir``; a skip reason for the others."""
    out = Path(out_dir)
    prefix = f"{label}: " if label else ""
    results = []
    if stats.expert_load is not None:
        results.append(PlotResult("expert_load", plots.plot_expert_load(
            stats.expert_load, out / "expert_load.png",
            f"{prefix}expert load over {stats.tokens:,} tokens (uniform = "
            f"{1 / stats.expert_load.shape[1]:.3f}, white line)")))
    else:
        results.append(PlotResult("expert_load", None, f"a '{stats.block}' model has no router"))
    if stats.coactivation is not None:
        results.append(PlotResult("coactivation", plots.plot_coactivation(
            stats.coactivation, out / "coactivation.png",
            f"{prefix}CoE expert co-activation over {stats.tokens:,} tokens")))
    else:
        results.append(PlotResult("coactivation", None,
                                  "co-activation between iterations is for CoE runs "
                                  f"(block='coe' with >= 2 iterations); this is '{stats.block}'"))
    if stats.gate_mean is not None:
        results.append(PlotResult("edge_gates", plots.plot_edge_gates(
            stats.gate_mean, stats.gate_std, out / "edge_gates.png",
            f"{prefix}{plots.EDGE_GATES_TITLE}, over {stats.tokens:,} tokens")))
        results.append(PlotResult("edge_gate_hist", plots.plot_edge_gate_histograms(
            stats.gate_samples, out / "edge_gate_hist.png",
            f"{prefix}DAG edge-gate magnitude across tokens")))
    else:
        reason = (f"edge gates are for DAG-MoE runs (aggregation 'dag'); this is "
                  f"'{stats.block}'" + (f" / '{stats.aggregation}'" if stats.aggregation else ""))
        results += [PlotResult("edge_gates", None, reason),
                    PlotResult("edge_gate_hist", None, reason)]
    for name, series, plot, metric, title in (
            ("dropped_fraction", dropped_series, plots.plot_dropped_fraction,
             "dropped_fraction", "assignments dropped by expert capacity or the exchange buffer"),
            ("load_balance", load_series, plots.plot_load_balance, "expert_load",
             "expert load during training (max / mean per layer; last record)")):
        steps, values = series(records)
        results.append(PlotResult(name, None, f"metrics.jsonl has no training records with "
                                              f"{metric}") if steps is None else
                       PlotResult(name, plot(steps, values, out / f"{name}.png",
                                             prefix + title)))
    results.append(training_curves(records, out, prefix))
    return results


def training_curves(records: List[dict], out: Path, prefix: str = "") -> PlotResult:
    """``training_curves.png``: the training loss and learning rate of ``records``."""
    curves = curve_series(records)
    if curves is None:
        return PlotResult("training_curves", None,
                          "metrics.jsonl has no training records with a loss")
    return PlotResult("training_curves", plots.plot_training_curves(
        *curves, out / "training_curves.png", f"{prefix}training loss and learning rate"))


def analyze_run(loaded: LoadedRun, run_dir, out_dir, *, data: str = "",
                max_batches: int = 4) -> List[PlotResult]:
    """Trace ``loaded``, the run read from ``run_dir`` (its newest checkpoint: what
    :func:`dagmoe_jax.run.load_run` or, for ``hf:FOLDER``, ``dagmoe_jax.hf.run.open_run``
    gives), over ``max_batches`` batches of its held-out data (or ``data``), and write every
    plot that applies into ``out_dir`` (the training curves from ``run_dir``'s metrics log)."""
    path = as_path(run_dir)
    path = path if is_remote(path) else Path(os.path.abspath(path))
    label = f"{path.parent.name}/{path.name} @ step {loaded.step}"
    own = family_of(loaded.model_cfg.block).part("analysis")
    if own is not None:                 # a family with its own analysis (DoE's gates per topic)
        return own.analyze(loaded, run_dir, out_dir, data, max_batches, label)
    batches = analysis_batches(loaded.data_cfg, loaded.tokenizer, data, max_batches)
    stats = collect(loaded.model, batches)
    return write_plots(stats, read_metrics(run_dir), out_dir, label) + [
        write_summary(stats, out_dir)]
