"""DoE specialisation: the mean gate of every knowledge block per topic (or domain) and layer.

The paper's Figure 2 shows, per layer, each expert's activation for each domain: layers where
the rows differ are "domain dispatchers", layers where they agree "converge on general
functions". :func:`gate_profile` measures it on batches carrying ``topics`` (inputs) and a
grouping of tokens (by default their LDA ``topic_labels``; a batch's ``domain`` [B] ids give the
paper's per-domain reading), :func:`specialisation` summarises each layer in one number and
:func:`plot_gate_profile` draws it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Optional

import jax
import numpy as np

from dagmoe_jax.analysis.collection import record
from dagmoe_jax.analysis.plots import _save, plt
from dagmoe_jax.analysis.report import (ROUTED_PLOTS, PlotResult, analysis_batches,
                                        training_curves)
from dagmoe_jax.run.extensions import extension_for
from dagmoe_jax.run.records import read_metrics

# This family's own plots, beside the core's (:data:`dagmoe_jax.analysis.report.PLOTS`).
PLOTS = ("doe_gates",)


def gate_profile(model, batches: Iterable[Dict[str, np.ndarray]], num_groups: int,
                 group_key: str = "topic_labels") -> np.ndarray:
    """Mean gate G [layers, groups, K] of a DoE model over ``batches``.

    ``group_key``: 'topic_labels' groups tokens by their LDA label (tokens with a null or
    padding label are left out) ; 'domain' groups every unmasked token of row b by
    ``batch['domain'][b]``. Groups without tokens are NaN rows.
    """
    sums, counts = None, np.zeros(num_groups)
    for batch in batches:
        topics = {"topics": jax.numpy.asarray(batch["topics"])}
        gates = np.asarray(record(model, batch["inputs"], features=topics)["gates"],
                           np.float64)                               # [layers, B, S, K]
        layers, b, s, k = gates.shape
        if group_key == "domain":
            groups = np.broadcast_to(np.asarray(batch["domain"])[:, None], (b, s))
            keep = np.asarray(batch.get("mask", np.ones((b, s), bool)), bool)
        else:
            groups = np.asarray(batch[group_key])
            keep = (groups >= 0) & (groups < num_groups)
        if sums is None:
            sums = np.zeros((layers, num_groups, k))
        g, flat = groups[keep], gates[:, keep]                  # [n], [layers, n, K]
        for layer in range(layers):
            np.add.at(sums[layer], g, flat[layer])
        counts += np.bincount(g, minlength=num_groups)
    with np.errstate(invalid="ignore"):
        return sums / counts[None, :, None]


def specialisation(profile: np.ndarray) -> np.ndarray:
    """Per layer [layers]: the mean over knowledge blocks of the across-group standard deviation
    of the mean gate, divided by the layer's mean gate (0: every group gates alike; larger: the
    layer dispatches groups to different blocks). NaN groups are ignored."""
    std = np.nanstd(profile, axis=1).mean(-1)
    mean = np.nanmean(profile, axis=(1, 2))
    return std / np.maximum(mean, 1e-12)


def plot_gate_profile(profile: np.ndarray, path, title: str = "",
                      group_names: Optional[list] = None):
    """One heatmap per layer: groups (rows) x knowledge blocks (columns), the mean gate."""
    layers, groups, k = profile.shape
    fig, axes = plt.subplots(1, layers, figsize=(max(6.0, 2.2 * layers + 1), 0.3 * groups + 2),
                             squeeze=False)
    vmax = float(np.nanmax(profile)) if np.isfinite(profile).any() else 1.0
    score = specialisation(profile)
    for layer, ax in enumerate(axes[0]):
        image = ax.imshow(profile[layer], aspect="auto", cmap="magma", vmin=0.0, vmax=vmax)
        ax.set_title(f"layer {layer}\nspec. {score[layer]:.2f}", fontsize=9)
        ax.set_xlabel("knowledge block")
        if layer == 0:
            ax.set_ylabel("group")
            if group_names:
                ax.set_yticks(range(groups))
                ax.set_yticklabels(group_names, fontsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), label="mean gate")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def analyze(loaded, run_dir, out_dir, data: str, max_batches: int, label: str
            ) -> List[PlotResult]:
    """A DoE run's analysis (:func:`dagmoe_jax.analysis.report.analyze_run` asks the family):
    the mean gate per LDA topic and layer (``doe_gates.png``); the routed blocks' plots do not
    apply."""
    skipped = [PlotResult(n, None, "not a routed (MoE / CoE) block") for n in ROUTED_PLOTS]
    skipped.append(training_curves(read_metrics(run_dir), Path(out_dir), f"{label}: "))
    annotate = extension_for(loaded.model_cfg).prepare_run(loaded.data_cfg, run_dir, save=False)
    if annotate is None:
        return skipped + [PlotResult("doe_gates", None, "a no-LDA DoE run has no topic labels")]
    batches = analysis_batches(loaded.data_cfg, loaded.tokenizer, data, max_batches, annotate)
    profile = gate_profile(loaded.model, batches, loaded.model_cfg.block.num_topics)
    path = plot_gate_profile(profile, Path(out_dir) / "doe_gates.png",
                             title=f"mean gate per LDA topic (rows) and layer, {label}")
    return skipped + [PlotResult("doe_gates", path)]
