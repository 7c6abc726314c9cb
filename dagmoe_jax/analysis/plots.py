"""PNG plots of routing and DAG statistics (matplotlib, Agg backend: no display needed).

Each function draws one figure from NumPy arrays, writes it to ``path`` and returns the path;
none of them reads a model or prints. The arrays come from
:func:`dagmoe_jax.analysis.collection.collect` and from ``metrics.jsonl``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib
import matplotlib.colors

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after selecting the backend)
import numpy as np  # noqa: E402


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_expert_load(load: np.ndarray, path, title: str = "") -> Path:
    """Heatmap of expert load, layers x experts: each cell is the share of the layer's routing
    slots that went to the expert (uniform = 1 / N, marked on the colour bar)."""
    load = np.asarray(load, np.float64)
    layers, n = load.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * n + 2), max(2.0, 0.45 * layers + 1.2)))
    image = ax.imshow(load, aspect="auto", cmap="viridis", vmin=0.0)
    bar = fig.colorbar(image, ax=ax, label="share of routing slots")
    bar.ax.axhline(1.0 / n, color="white", linewidth=1.5)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n))
    ax.set_yticks(range(layers))
    ax.set_title(title or f"expert load (uniform = {1.0 / n:.3f}, white line)")
    return _save(fig, path)


def plot_coactivation(counts: np.ndarray, path, title: str = "") -> Path:
    """CoE expert co-activation between consecutive iterations (CoE Figure 8): one N x N
    panel per layer (and iteration pair); cell (a, b) counts tokens that used expert a in
    iteration t and expert b in iteration t + 1."""
    counts = np.asarray(counts, np.float64)
    layers, pairs, n, _ = counts.shape
    fig, axes = plt.subplots(pairs, layers, figsize=(3.2 * layers + 0.6, 3.0 * pairs + 0.4),
                             squeeze=False, layout="constrained")
    for l in range(layers):
        for t in range(pairs):
            ax = axes[t][l]
            image = ax.imshow(counts[l, t], cmap="magma", vmin=0.0)
            ax.set_title(f"layer {l}: iteration {t} -> {t + 1}", fontsize=9)
            ax.set_xlabel(f"expert in iteration {t + 1}", fontsize=8)
            ax.set_ylabel(f"expert in iteration {t}", fontsize=8)
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
    fig.suptitle(title or "CoE expert co-activation (token counts)", fontsize=10)
    return _save(fig, path)


EDGE_GATES_TITLE = ("How much each routed expert's output feeds each other one: DAG edge-gate "
                     "magnitude mean_d |e_(i,j)| (row i receives from column j)")

# Up to this many nodes (K x K cells) every cell of edge_gates.png is labelled with its value.
_LABEL_CELLS_UP_TO = 4


def edge_gates_figure(mean: np.ndarray, std: np.ndarray, title: str = ""):
    """The figure of :func:`plot_edge_gates` (not saved; tests read its images)."""
    mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    layers, iters, k, _ = mean.shape
    fig, axes = plt.subplots(layers, 2 * iters, figsize=(2.6 * 2 * iters + 1.2, 2.4 * layers + 0.8),
                             squeeze=False, layout="constrained")
    ticks = range(k)
    labels = [str(i + 1) for i in ticks]
    kinds = ((mean, "mean over tokens", "viridis"), (std, "std over tokens", "cividis"))
    # One colour scale per kind for the whole figure, from 0: equal colours are equal gates
    # in every panel, and gates that differ by 2% look alike.
    norms = [matplotlib.colors.Normalize(0.0, max(float(data.max()), 1e-12)) for data, _, _ in kinds]
    images = [[], []]
    for l in range(layers):
        for it in range(iters):
            for col, ((data, name, cmap), norm) in enumerate(zip(kinds, norms)):
                ax = axes[l][2 * it + col]
                images[col].append(ax.imshow(data[l, it], cmap=cmap, norm=norm))
                ax.set_title(f"layer {l}, iteration {it + 1}: {name}", fontsize=8)
                ax.set_xticks(ticks, labels, fontsize=7)
                ax.set_yticks(ticks, labels, fontsize=7)
                ax.set_xlabel("from node j (router rank)", fontsize=7)
                ax.set_ylabel("to node i (router rank)", fontsize=7)
                if k <= _LABEL_CELLS_UP_TO:
                    for i in range(k):
                        for j in range(k):
                            value = data[l, it, i, j]
                            light = norm(value) < 0.5
                            ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=7,
                                    color="white" if light else "black")
    for col, (_, name, _) in enumerate(kinds):
        bar = fig.colorbar(images[col][0], ax=axes.ravel().tolist(), location="right",
                           fraction=0.03, pad=0.02, shrink=0.9)
        bar.set_label(f"gate magnitude, {name}", fontsize=7)
        bar.ax.tick_params(labelsize=6)
    fig.suptitle(title or EDGE_GATES_TITLE, fontsize=10)
    return fig


def plot_edge_gates(mean: np.ndarray, std: np.ndarray, path, title: str = "") -> Path:
    """DAG edge gates per layer (rows) and iteration: the K x K mean over tokens of the gate
    magnitude mean_d |e_(i,j)| (left panel of each pair) and its standard deviation across
    tokens (right). Row i is the receiving node, column j the sending node, in router rank
    order (rank 1 = highest score). All mean panels share one colour scale from 0, and all
    standard-deviation panels another, each with one colour bar; for K <= 4 every cell also
    shows its value."""
    return _save(edge_gates_figure(mean, std, title), path)


def plot_edge_gate_histograms(samples: np.ndarray, path, title: str = "") -> Path:
    """How the gates vary across tokens: per layer and iteration, the histogram over tokens of
    each node pair's gate magnitude, one line per receiving node i (pairs pooled over j) and
    the pooled histogram of all pairs."""
    samples = np.asarray(samples, np.float64)                 # [layers, L, M, K, K]
    layers, iters, _, k, _ = samples.shape
    fig, axes = plt.subplots(layers, iters, figsize=(3.4 * iters + 0.5, 2.6 * layers + 0.6),
                             squeeze=False, layout="constrained")
    for l in range(layers):
        for it in range(iters):
            ax = axes[l][it]
            values = samples[l, it]
            bins = np.linspace(0.0, max(float(values.max()), 1e-6), 31)
            ax.hist(values.reshape(-1), bins=bins, color="0.8", label="all pairs")
            for i in range(k):
                counts, edges = np.histogram(values[:, i, :].reshape(-1), bins=bins)
                ax.plot(0.5 * (edges[1:] + edges[:-1]), counts, linewidth=1.0,
                        label=f"to node {i + 1}")
            ax.set_title(f"layer {l}, iter {it + 1}", fontsize=8)
            ax.set_xlabel("gate magnitude", fontsize=7)
            ax.set_ylabel("token-pairs", fontsize=7)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title or "DAG edge-gate magnitude across tokens", fontsize=10)
    return _save(fig, path)


def plot_dropped_fraction(steps: Sequence[int], fractions: np.ndarray, path, title: str = "") -> Path:
    """Share of routing assignments dropped by capacity dispatch over training, one line per
    layer (``fractions`` [records, layers])."""
    fractions = np.asarray(fractions, np.float64)
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    for l in range(fractions.shape[1]):
        ax.plot(steps, 100.0 * fractions[:, l], label=f"layer {l}", linewidth=1.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("dropped assignments (%)")
    ax.set_ylim(bottom=0.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "tokens dropped by expert capacity during training")
    return _save(fig, path)


def plot_load_balance(steps: Sequence[int], loads: np.ndarray, path, title: str = "") -> Path:
    """Expert load during training from ``metrics.jsonl`` (``loads`` [records, layers, N], the
    share of each layer's routing assignments per expert): each layer's imbalance, max over
    mean load (1 = balanced), over the training steps (left), and the last record's load,
    layers x experts (right; uniform = 1 / N, marked on the colour bar)."""
    loads = np.asarray(loads, np.float64)
    _, layers, n = loads.shape
    imbalance = loads.max(-1) / np.maximum(loads.mean(-1), 1e-12)
    fig, (left, right) = plt.subplots(1, 2, figsize=(6.0 + max(3.0, 0.3 * n + 1.5), 3.4),
                                      width_ratios=(6.0, max(3.0, 0.3 * n + 1.5)),
                                      layout="constrained")
    for l in range(layers):
        left.plot(steps, imbalance[:, l], label=f"layer {l}", linewidth=1.2)
    left.axhline(1.0, color="0.5", linewidth=0.8, linestyle="--")
    left.set_xlabel("training step")
    left.set_ylabel("max / mean expert load")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    image = right.imshow(loads[-1], aspect="auto", cmap="viridis", vmin=0.0)
    bar = fig.colorbar(image, ax=right, label="share of routing slots")
    bar.ax.axhline(1.0 / n, color="white", linewidth=1.5)
    right.set_xlabel("expert")
    right.set_ylabel("layer")
    right.set_yticks(range(layers))
    right.set_title(f"step {steps[-1]}", fontsize=9)
    fig.suptitle(title or "expert load during training", fontsize=10)
    return _save(fig, path)


def plot_training_curves(steps: Sequence[int], loss: np.ndarray, learning_rate: np.ndarray,
                         eval_steps: Sequence[int], eval_loss: np.ndarray, path,
                         title: str = "") -> Path:
    """The training loss (and the held-out loss at each evaluation, as points) over training
    steps, above the learning rate on the same step axis (two panels)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 4.8), sharex=True,
                                      height_ratios=(2.0, 1.0), layout="constrained")
    top.plot(steps, loss, linewidth=1.2, label="training loss")
    if len(eval_steps):
        top.plot(eval_steps, eval_loss, "o", markersize=4, label="held-out loss")
    top.set_ylabel("loss (nats/token)")
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    bottom.plot(steps, learning_rate, color="tab:orange", linewidth=1.2)
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("training step")
    bottom.set_ylim(bottom=0.0)
    bottom.grid(alpha=0.3)
    fig.suptitle(title or "training loss and learning rate", fontsize=10)
    return _save(fig, path)
