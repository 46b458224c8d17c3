"""Plots every lesson uses: each function takes plain data and returns a matplotlib Figure.

Nothing here starts processes or needs a display: the figures draw with any backend (inline in a
notebook, Agg on a headless machine), and `fig.savefig(path)` writes them to a file. The plots of
one lesson live in its own module beside this one (viz_collectives, viz_dp, viz_zero, viz_tp,
viz_pipeline, viz_3d, viz_planner).

    loss_curve(runs)      loss against step for several runs, overlaid
    memory_bars(runs)     per-rank memory by category, stacked bars, one bar per run
    memory_compare(...)   predicted next to measured memory by category, with their ratio
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from minipar.memory import CATEGORIES


def loss_curve(runs: dict[str, list[float]], title: str = "training loss",
               val: list[tuple] | None = None) -> Figure:
    """Loss against step, one line per run ({label: losses}); equal runs draw on top of each other.
    val: [(step, held-out loss)] (TrainResult.val_losses), drawn as points on the same axes."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (label, losses), style in zip(runs.items(), ["-", "--", ":", "-."] * len(runs)):
        ax.plot(range(1, len(losses) + 1), losses, style, label=label)
    if val:
        ax.plot(*zip(*val), "o", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def memory_bars(runs: dict[str, list[dict]], title: str = "memory per rank") -> Figure:
    """Stacked bars of memory by category ({label: peak memory by rank, {category: bytes}}), MiB.

    One bar per run, for its fullest rank; categories in `memory.CATEGORIES` order, others after.
    """
    fullest = {label: max(ranks, key=lambda m: sum(m.values())) for label, ranks in runs.items()}
    cats = [*CATEGORIES, *sorted({c for m in fullest.values() for c in m} - set(CATEGORIES))]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(runs), 3.8), layout="constrained")
    bottom = np.zeros(len(runs))
    for cat in cats:
        mib = np.array([m.get(cat, 0) / 2**20 for m in fullest.values()])
        ax.bar(list(runs), mib, 0.6, bottom=bottom, label=cat)
        bottom += mib
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.12 * max(bottom, default=1))  # room above the tallest bar for its total
    ax.set(ylabel="MiB (fullest rank)", title=title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def memory_compare(panels: dict[str, dict[str, tuple[dict, dict]]],
                   title: str = "predicted and measured memory") -> Figure:
    """Predicted next to measured memory by category, MiB: {panel: {label: (predicted, measured)}}.

    Each label gets two stacked bars, predicted (hatched, left) and measured (right), categories in
    `memory.CATEGORIES` order and colour; the measured / predicted ratio of the totals is written
    above the pair. Panels share the y axis, so they compare at a glance (e.g. one panel per dp).
    """
    colours = dict(zip(CATEGORIES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    width = max(len(runs) for runs in panels.values())
    fig, axes = plt.subplots(1, len(panels), figsize=(1.5 + 1.2 * width * len(panels), 4.0),
                             sharey=True,
                             squeeze=False, layout="constrained")
    top = 0
    for ax, (name, runs) in zip(axes[0], panels.items()):
        for x, (label, pair) in enumerate(runs.items()):
            for dx, m, hatch in ((-0.2, pair[0], "//"), (0.2, pair[1], None)):
                bottom = 0.0
                for cat in CATEGORIES:
                    mib = m.get(cat, 0) / 2**20
                    ax.bar(x + dx, mib, 0.38, bottom=bottom, color=colours[cat], hatch=hatch,
                           ec="white", lw=0.3)
                    bottom += mib
            total = [sum(m.get(c, 0) for c in CATEGORIES) for m in pair]
            top = max(top, *total)
            ax.text(x, max(total) / 2**20, f"×{total[1] / total[0]:.3f}", ha="center", va="bottom",
                    fontsize=8)
        ax.set_xticks(range(len(runs)), list(runs), fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_ylim(0, 1.12 * top / 2**20)  # room above the tallest pair for its ratio
    axes[0, 0].set_ylabel("MiB per rank (left: predicted, right: measured)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[c]) for c in CATEGORIES]
    handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", ec="grey", hatch="//"))
    handles.append(plt.Line2D([], [], ls="none"))  # no mark: explains the numbers above the pairs
    axes[0, -1].legend(handles, [*CATEGORIES, "predicted",
                                 "×r above a pair:\nmeasured / predicted"],
                       fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    return fig
