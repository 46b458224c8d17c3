"""Plots for the 3D-parallelism lesson (06): each function takes plain data and returns a Figure.

    rank_grid(mesh, labels)           the dp x tp x pp grid: one box per global rank, a row per
                                      pipeline stage, coloured by stage, columns grouped
                                      by data-parallel replica
    throughput(labels, tokens, sent, predicted)
                                      tokens/s and bytes sent per rank and step, one bar per layout;
                                      the predicted bytes as a black tick on each bar
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

STAGE_COLOURS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def rank_grid(mesh, labels: dict[int, str], title: str = "") -> Figure:
    """One box per global rank of `mesh` (a `minipar.Mesh`), placed by its coordinates: pipeline
    stage pp_rank is the row (stage 0 on top), the columns are the data-parallel replicas (dashed
    frames), each cut into its tp ranks. A box shows the rank, its (dp, tp, pp) coordinates and
    `labels[rank]`; brackets under a row join the ranks of one tensor-parallel group."""
    dp, tp, pp = mesh.dp, mesh.tp, mesh.pp
    w, h, gap = 2.6, 1.5, 0.5  # a box, and the space between replicas
    fig, ax = plt.subplots(figsize=(1.0 + dp * (tp * w + gap), 0.9 + pp * (h + 0.45)),
                           layout="constrained")
    x_of = lambda c: c.dp_rank * (tp * w + gap) + c.tp_rank * w  # noqa: E731
    y_of = lambda c: (pp - 1 - c.pp_rank) * (h + 0.45)  # noqa: E731
    for rank in range(mesh.world):
        c = mesh.coords(rank)
        x, y = x_of(c), y_of(c)
        ax.add_patch(plt.Rectangle((x + 0.05, y), w - 0.1, h, fc=STAGE_COLOURS[c.pp_rank % 10],
                                   alpha=0.35,
                                   ec="black", lw=1.2))
        ax.text(x + w / 2, y + h - 0.12, f"rank {rank}", ha="center", va="top", fontsize=10,
                weight="bold")
        ax.text(x + w / 2, y + h - 0.42, f"dp {c.dp_rank} · tp {c.tp_rank} · pp {c.pp_rank}",
                ha="center",
                va="top", fontsize=8)
        ax.text(x + w / 2, y + h - 0.68, labels.get(rank, ""), ha="center", va="top", fontsize=7,
                linespacing=1.3)
    tp_groups = mesh.axis_groups("tp")  # a bracket names its group's index there, as the boxes do
    for d in range(dp):  # a data-parallel replica: a whole copy of the model, over tp x pp ranks
        x = d * (tp * w + gap)
        ax.add_patch(plt.Rectangle((x - 0.05, -0.35), tp * w + 0.1, pp * (h + 0.45) + 0.05,
                                   fill=False,
                                   ls="--", ec="grey", lw=1))
        ax.text(x + tp * w / 2, pp * (h + 0.45) - 0.2, f"data-parallel replica {d}", ha="center",
                va="bottom",
                fontsize=9, color="dimgrey")
        for s in range(pp):  # the tensor-parallel group of this replica and stage
            y = (pp - 1 - s) * (h + 0.45) - 0.08
            ax.plot([x + 0.15, x + 0.15, x + tp * w - 0.15, x + tp * w - 0.15],
                    [y + 0.06, y, y, y + 0.06],
                    color="black", lw=0.8)
            first, last = mesh.global_rank(d, 0, s), mesh.global_rank(d, tp - 1, s)
            group = next(i for i, g in enumerate(tp_groups) if first in g)
            ranks = f"ranks {first}..{last}" if last > first else f"rank {first}"
            ax.text(x + tp * w / 2, y - 0.03, f"TP group {group}: {ranks}", ha="center",
                    va="top", fontsize=7)
    ax.set_xlim(-0.3, dp * (tp * w + gap) - gap + 0.3)
    ax.set_ylim(-0.45, pp * (h + 0.45) + 0.2)
    ax.set_yticks([y_of(mesh.coords(mesh.global_rank(0, 0, s))) + h / 2 for s in range(pp)],
                  [f"stage {s}" for s in range(pp)])
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"dp {dp} × tp {tp} × pp {pp} = {mesh.world} ranks", fontsize=10)
    return fig


def throughput(labels: list[str], tokens_per_s: list[float], sent: list[float] | None = None,
               title: str = "", predicted: list[float] | None = None,
               predicted_tokens: list[float] | None = None) -> Figure:
    """Tokens per second of each layout (bars) and, if given, the bytes each rank sends per step
    (right panel, the mean over ranks, measured), with the values written on the bars; `predicted`
    (bytes, the same mean from the formulas) draws a black tick on each bar of that panel, and
    `predicted_tokens` (tokens per second, the planner's) one on each bar of the first."""
    panels = 2 if sent is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 0.8 + 0.32 * len(labels)),
                             squeeze=False,
                             sharey=True, layout="constrained")
    y = np.arange(len(labels))
    series = [(tokens_per_s, "tokens / s (global)", "{:,.0f}")]
    if sent is not None:
        series.append(([b / 2**10 for b in sent], "KiB sent per rank per step (mean)", "{:,.0f}"))
    for ax, (values, xlabel, fmt) in zip(axes[0], series):
        ax.barh(y, values, 0.6, color=STAGE_COLOURS[0] if ax is axes[0, 0] else STAGE_COLOURS[1],
                label="measured")
        for i, v in enumerate(values):
            ax.text(v, i, " " + fmt.format(v), va="center", fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_xlim(0, 1.2 * max(values) if max(values) > 0 else 1)
        ax.grid(axis="x", alpha=0.3)
    ticks = [(axes[0, 0], predicted_tokens, tokens_per_s)]
    if sent is not None and predicted is not None:
        ticks.append((axes[0, 1], [b / 2**10 for b in predicted], [b / 2**10 for b in sent]))
    for ax, values, measured in ticks:
        if values is None:
            continue
        ax.scatter(values, y, marker="|", s=250, linewidths=2, color="black", zorder=3,
                   label="predicted")
        ax.set_xlim(0, 1.2 * max(list(values) + list(measured) + [1e-9]))
        ax.legend(loc="lower left", bbox_to_anchor=(1.0, 0.0), fontsize=7)   # beside: no bar hidden
    axes[0, 0].set_yticks(y, labels, fontsize=8)
    axes[0, 0].invert_yaxis()
    if title:
        fig.suptitle(title)
    return fig
