"""Pictures of what a Synthesizer learned, shared by TensorBoard logging and the study's figures.

Pure functions of a model or a state dict (no files, no process groups):
- `synthesizer_matrices(state)`: the learned Random / Fixed Random / Factorized Random logit matrices per
  layer, [heads, N, N] (Factorized Random as R1 R2^T), from our names or the export's HF names;
- `mixture_grids(model)`: the softmax mixture weights as a [layers, heads] grid per stack and mixer;
- `synthesizer_images(model)`: both as labelled figures (a heatmap per head with the layer's colour bar; bars
  per head and layer) rendered to HWC uint8 for `MetricsLogger.write_images`;
- `attention_maps(model, input_ids)`: the first encoder layer's attention probabilities per mixer and mixed,
  recomputed from the layer's own weights (the paper's Dense-vs-vanilla picture).
The matplotlib figures of the study and of `pretrain.plot` live here too (`plot_*`, `plot_intervals` for the
study's paired differences), one PNG each.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch


# --------------------------------------------------------------------------------------------------------
# matplotlib figures (PNG files)
# --------------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on clusters and CI
    import matplotlib.pyplot as plt

    return plt


def plot_curves(series: Mapping[str, Sequence[tuple[float, float]]], path: Path, xlabel: str, ylabel: str,
                title: str = "") -> Path:
    """One line per label from (x, y) points; labels sharing a prefix before ' seed' share a colour."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours: dict[str, str] = {}
    for label, points in series.items():
        if not points:
            continue
        group = label.split(" seed")[0]
        xs, ys = zip(*points)
        line = ax.plot(xs, ys, label=label, color=colours.get(group), linewidth=1.2)[0]
        colours.setdefault(group, line.get_color())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_panels(runs: Mapping[str, Sequence[dict]], metrics: Sequence[str], path: Path, x: str = "step") -> Path:
    """One panel per metric, one line per run ({label: metrics.jsonl records}), against `x` (step, tokens_seen),
    under a title naming what is plotted and for which runs."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(metrics), 1, figsize=(7, 2.8 * len(metrics)), squeeze=False, sharex=True)
    fig.suptitle(f"{', '.join(metrics)} against {x}: {', '.join(runs)}", fontsize=10)
    for ax, metric in zip(axes[:, 0], metrics):
        for label, records in runs.items():
            points = [(r[x], r[metric]) for r in records if metric in r and x in r]
            if points:
                ax.plot(*zip(*points), label=label, linewidth=1.2, marker=".")  # a marker: single evaluations show
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    axes[-1, 0].set_xlabel(x)
    return _save(fig, path)


def plot_bars(means: Mapping[str, Mapping[str, float]], stds: Mapping[str, Mapping[str, float]], path: Path,
              title: str = "") -> Path:
    """Grouped bars: one group per metric, one bar per variant, error bars of one standard deviation."""
    plt = _pyplot()
    variants = list(means)
    metrics = sorted({m for v in means.values() for m in v})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(metrics) * max(1, len(variants)) / 3), 4.2))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(metrics))]
        ys = [means[variant].get(m, np.nan) for m in metrics]
        errs = [stds[variant].get(m, 0.0) for m in metrics]
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=variant)
    ax.set_xticks(range(len(metrics)), metrics, fontsize=8)
    if title:
        ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_intervals(panels: Mapping[str, Mapping[str, tuple[float, float, float]]], refs: Mapping[str, float],
                   path: Path, title: str = "") -> Path:
    """One panel per metric ({panel: {label: (mean, lo, hi)}}): a point per label with its interval as an error
    bar (none where lo/hi are NaN: one seed), and a dashed line at the panel's reference (0 or 1: no difference)."""
    plt = _pyplot()
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (panel, points) in zip(axes.flat, panels.items()):
        labels = list(points)
        means = np.array([points[k][0] for k in labels], dtype=float)
        lo = np.array([points[k][1] for k in labels], dtype=float)
        hi = np.array([points[k][2] for k in labels], dtype=float)
        errors = np.nan_to_num(np.stack([means - lo, hi - means]), nan=0.0)
        ax.errorbar(range(len(labels)), means, yerr=errors, fmt="o", capsize=4)
        ax.axhline(refs.get(panel, 0.0), color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(panel, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_mixture(series: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]], path: Path, title: str) -> Path:
    """One panel per layer ({layer: {mixer: [(step, weight)]}}), one line per mixer."""
    plt = _pyplot()
    layers = list(series)
    cols = min(4, len(layers))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, sharey=True)
    for ax, layer in zip(axes.flat, layers):
        for mixer, points in series[layer].items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=mixer)
        ax.set_title(layer, fontsize=8)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.supxlabel("step", fontsize=8)
    return _save(fig, path)


def plot_heads(matrices: Mapping[str, torch.Tensor], path: Path, title: str) -> Path:
    """Rows of per-head heatmaps ({row label: [heads, n, m]}), as the paper's figure of learned matrices."""
    plt = _pyplot()
    labels = list(matrices)
    heads = max(m.shape[0] for m in matrices.values())
    fig, axes = plt.subplots(len(labels), heads, figsize=(1.9 * heads, 1.9 * len(labels) + 0.4), squeeze=False)
    for row, label in enumerate(labels):
        for h in range(heads):
            ax = axes[row, h]
            ax.set_xticks([])
            ax.set_yticks([])
            if h < matrices[label].shape[0]:
                ax.imshow(matrices[label][h].cpu().numpy(), cmap="viridis", interpolation="nearest")
            if row == 0:
                ax.set_title(f"head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel(label, fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_attention(maps: Mapping[str, torch.Tensor], tokens: Sequence[str], path: Path, title: str,
                   head: int = 0) -> Path:
    """Side by side: one attention map per label ({label: [heads, n, n]}, `head` shown), tokens on the axes."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(maps), figsize=(5 * len(maps), 5), squeeze=False)
    for ax, (label, m) in zip(axes[0], maps.items()):
        ax.imshow(m[head].cpu().numpy(), cmap="viridis", vmin=0)
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=6)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=6)
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path
