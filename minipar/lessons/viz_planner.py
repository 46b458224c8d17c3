"""Plots for the planner lesson (07): each function takes planner `Estimate`s (or plain numbers) and
returns a matplotlib Figure. They draw what an estimate holds and recompute nothing: the pipeline an
estimate simulated is `est.timeline` (a `pipeline.Timeline` in seconds, for `viz_pipeline.gantt`;
its makespan + dp_comm + optimizer is the step time).

    memory_stages(est)     memory per GPU of every pipeline stage, by category, and its capacity
    breakdown(estimates)   step times cut into the planner's terms (planner.TERMS), a bar each
    ratios(rows)           predicted / published for several runs, with a band (e.g. our 10%)
    splits(estimates)      layers per pipeline chunk and micro-batches per DP replica, by GPU kind
    matmul_fit(fits)       a matmul fit's predicted against measured seconds, shape by shape
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib import ticker
from matplotlib.figure import Figure

from minipar import planner
from minipar.memory import CATEGORIES
from minipar.mesh import layout_ranks
from minipar.planner import predict
from minipar.planner.cluster import memory_unit

COLOURS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
TERM_COLOURS = dict(zip(planner.TERMS,
                        ["#4C72B0", "#8172B3", "#937860", "#DD8452", "#CCB974", "#64B5CD",
                         "#C8C8C8", "#DA8BC3", "#55A868", "#C44E52"]))


def memory_stages(est, ax=None, title: str | None = None) -> Figure:
    """Memory per GPU of each pipeline stage (`est.stages`), stacked in `memory.CATEGORIES` order,
    in GiB or, below 1 GiB, MiB (`memory_unit`), with each stage's capacity (what its GPUs' counted
    tensors may fill, `predict.capacities`) as a black tick, or in the legend when it is over 20x
    the fullest stage (a tick that high would squash the bars flat)."""
    unit, name = memory_unit(*(sum(stage.values()) for stage in est.stages))
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.5, 2.5 + 0.5 * len(est.stages)), 3.6),
                             layout="constrained")
    stages = range(len(est.stages))
    bottom = [0.0 for _ in stages]
    for i, cat in enumerate(CATEGORIES):
        gib = [est.stages[r].get(cat, 0) / unit for r in stages]
        ax.bar(list(stages), gib, 0.7, bottom=bottom, color=COLOURS[i], label=cat)
        bottom = [b + g for b, g in zip(bottom, gib)]
    capacity = [c / unit for c in predict.capacities(est.cluster, est.par)]
    usable = f"usable ({est.cluster.usable:.0%} of memory)"
    off = 0 < 20 * max(bottom) < max(capacity)  # a tick that far up would flatten the bars
    if off:
        top = f"{min(capacity):,.0f}..{max(capacity):,.0f}" if min(capacity) < max(capacity) \
            else f"{max(capacity):,.0f}"
        ax.plot([], [], ls="none", label=f"{usable}:\n{top} {name}, off the scale")
    else:
        ax.hlines(capacity, [r - 0.4 for r in stages], [r + 0.4 for r in stages], colors="black",
                  lw=2, label=usable)
    if len(est.stages) <= 16:
        for r, total in zip(stages, bottom):
            ax.text(r, total, f"{total:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(stages), [str(r) for r in stages], fontsize=7 if len(est.stages) > 16 else 9)
    pad = max(0.0, (3 - len(est.stages)) / 2)  # a bar or two do not fill the axes
    ax.set(xlabel="pipeline stage", ylabel=f"{name} per GPU",
           ylim=(0, 1.15 * max(max(bottom), 0 if off else max(capacity))),
           xlim=(-0.6 - pad, len(est.stages) - 0.4 + pad))
    ax.set_title(title or f"memory per GPU, {est.label}", fontsize=10, loc="left")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return ax.figure


def breakdown(estimates: dict, ax=None, title: str = "where the step time goes") -> Figure:
    """{label: Estimate} as horizontal bars of seconds, cut into the terms of `planner.TERMS`."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.6 + 0.45 * len(estimates)), layout="constrained")
    labels = list(estimates)
    left = [0.0] * len(labels)
    for term in planner.TERMS:
        widths = [estimates[k].breakdown[term] for k in labels]
        ax.barh(range(len(labels)), widths, 0.6, left=left, color=TERM_COLOURS[term], label=term)
        left = [x + w for x, w in zip(left, widths)]
    for y, k in enumerate(labels):
        ax.text(left[y], y, f" {estimates[k].step_time:.4g} s", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlim(0, 1.18 * max(left))
    ax.invert_yaxis()
    ax.set_xlabel("seconds a step")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return ax.figure


def ratios(
    rows: dict[str, dict[str, float]], band: float = 0.10, title: str = "predicted / published"
) -> Figure:
    """{row: {series: predicted / published}} as grouped horizontal
    bars around 1, the ±band shaded."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(rows)), layout="constrained")
    series = list(dict.fromkeys(s for r in rows.values() for s in r))
    h = 0.8 / len(series)
    for i, s in enumerate(series):
        ys = [y + (i - (len(series) - 1) / 2) * h for y in range(len(rows))]
        vals = [r.get(s, float("nan")) for r in rows.values()]
        ax.barh(ys, [v - 1 for v in vals], h, left=1, color=COLOURS[i], label=s)
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:.3f} " if v >= 1 else f"{v:.3f} ", va="center",
                    ha="left" if v >= 1 else "right",
                    fontsize=7)
    ax.axvspan(1 - band, 1 + band, color="grey", alpha=0.15, label=f"±{band:.0%}")
    ax.axvline(1, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_xlim(1 - 1.6 * band, 1 + 1.6 * band)
    ax.set_xlabel("ratio: minipar's prediction / published (1 = equal)")
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return fig


def splits(estimates: dict, title: str = "how the work is split") -> Figure:
    """{label: Estimate}: left, the layers of each pipeline chunk; right, the micro-batches of each
    DP replica; every segment coloured by the GPU kind of its ranks (grey: ranks of several kinds)
    and labelled with its count."""
    kinds = list(dict.fromkeys(g.name for e in estimates.values()
                               for g in (e.cluster.groups or (e.cluster,))))
    colour = {k: COLOURS[i % len(COLOURS)] for i, k in enumerate(kinds)}
    colour["several kinds"] = "#A0A0A0"
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.9 + 0.55 * len(estimates)), sharey=True,
                             layout="constrained")
    for y, (label, e) in enumerate(estimates.items()):
        par, p = e.par, e.par.pp
        parts = (("layers", e.layers, lambda c: layout_ranks(par, pp_rank=c % p)),
                 ("micro-batches", e.shares, lambda j: layout_ranks(par, dp_rank=j)))
        for ax, (_, counts, ranks_of) in zip(axes, parts):
            left = 0
            for i, n in enumerate(counts):
                names = {e.cluster.device(r).name for r in ranks_of(i)}
                kind = names.pop() if len(names) == 1 else "several kinds"
                ax.barh(y, n, 0.6, left=left, color=colour[kind], ec="white", lw=1)
                ax.text(left + n / 2, y, str(n), ha="center", va="center", fontsize=8,
                        color="white")
                left += n
    for ax, what in zip(axes, ("layers per pipeline chunk (stage order)", "micro-batches per DP "
                                                                          "replica")):
        ax.set_title(what, fontsize=10, loc="left")
        ax.set_xticks([])
    axes[0].set_yticks(range(len(estimates)), list(estimates), fontsize=8)
    axes[0].invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[k]) for k in colour]
    axes[1].legend(handles, list(colour), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    return fig


def matmul_fit(fits: dict, title: str = "matmuls on this CPU: predicted / measured") -> Figure:
    """{label: planner.matmul_fit.MatmulFit} as predicted / measured seconds against the matmul's
    FLOPs, a marker per shape and fit (log x), with the 1.0 line."""
    fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
    for i, (label, fit) in enumerate(fits.items()):
        flops = [2 * m * n * k for (m, n, k), _ in fit.samples]
        ax.scatter(flops, [1 + e for e in fit.errors()], s=12, color=COLOURS[i], label=label)
    ax.axhline(1.0, color="black", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="FLOPs of the matmul", ylabel="predicted / measured")
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))  # 0.3, 0.5, 1, 2...
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return fig
