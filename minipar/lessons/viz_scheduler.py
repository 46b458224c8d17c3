"""Plots for the scheduling lesson (10): each function takes the scheduler's plain data (Jobs, a
`simulate` Result's segments, a throughput matrix) and returns a matplotlib Figure, or for the
widget a list of Output outputs. They draw what they are given and recompute nothing.

    trace_shape(jobs, durations)   a trace's scale factors and durations against Gavel's stated
                                   distribution (scheduler/jobs.py)
    heatmap(table)                 steps/s of each job type on each (kind, count), log colour, a
                                   dash where nothing fits
    gantt(segments, jobs)          one row a job: what it held when, coloured by kind, the bar's
                                   height its share of the most chips any job held, a layout or a
                                   count written in the bar
    occupancy(segments, capacity)  the share of each kind's chips held, over time
    schedule(result, jobs)         gantt over occupancy, one time axis: the cluster's occupancy
    timelines(panels, jobs)        several gantts on one time axis (measured over simulated)
    jct_cdf(results)               each policy's job completion times as a cumulative distribution
    panel(result, jobs)            the widget's outputs (minipar.lessons.widgets.schedule): the
                                   schedule as a PNG and its metrics as text
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from minipar.lessons.explorer_html import png, text

COLOURS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
SCALES, SCALE_P = (1, 2, 4, 8), (0.70, 0.10, 0.15, 0.05)   # Gavel's, as scheduler.jobs states


def _kind_colours(kinds) -> dict:
    """A colour for each kind, in order of first appearance."""
    return {k: COLOURS[i % len(COLOURS)] for i, k in enumerate(dict.fromkeys(kinds))}


def trace_shape(jobs, durations: list[float], title: str | None = None) -> Figure:
    """Left: the share of jobs at each scale factor, drawn beside Gavel's probabilities. Right: the
    durations (seconds, on the reference kind at the job's scale) as a histogram of log10 minutes,
    over Gavel's density: 0.8 x U(1.5, 3) + 0.2 x U(3, 4)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
    shares = [sum(j.scale == s for j in jobs) / len(jobs) for s in SCALES]
    x = np.arange(len(SCALES))
    left.bar(x - 0.2, shares, 0.4, label=f"drawn ({len(jobs):,} jobs)")
    left.bar(x + 0.2, SCALE_P, 0.4, color="grey", alpha=0.6, label="Gavel's probability")
    left.set_xticks(x, [str(s) for s in SCALES])
    left.set(xlabel="scale factor (chips asked for)", ylabel="share of jobs")
    left.legend(fontsize=8)
    logs = [math.log10(d / 60) for d in durations]
    right.hist(logs, bins=np.arange(1.5, 4.01, 0.125), density=True, alpha=0.7, label="drawn")
    right.step([1.5, 1.5, 3, 4], [0, 0.8 / 1.5, 0.2, 0.2], where="post", color="black", lw=1.2,
               label="Gavel's density")
    right.set(xlabel="duration, log10 minutes (on the reference kind)", ylabel="density")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def heatmap(table: dict, title: str | None = None) -> Figure:
    """table: {job type label: {(kind, count): steps/s}}; one row a type, one column a (kind,
    count), kinds in the order met; the colour is log10 steps/s, each cell written, a dash where
    the rate is 0 (no layout fits)."""
    cols = list(dict.fromkeys(c for row in table.values() for c in row))
    rows = list(table)
    values = np.array([[table[r].get(c, 0.0) for c in cols] for r in rows])
    shown = np.ma.masked_where(values <= 0, np.log10(np.where(values > 0, values, 1.0)))
    fig, ax = plt.subplots(figsize=(1.2 + 0.62 * len(cols), 1.1 + 0.48 * len(rows)),
                           layout="constrained")
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#DDDDDD")
    image = ax.imshow(shown, cmap=cmap, aspect="auto")
    for i in range(len(rows)):
        for j in range(len(cols)):
            v = values[i, j]
            ax.text(j, i, f"{v:.3g}" if v > 0 else "—", ha="center", va="center", fontsize=7,
                    color="white" if v > 0 and shown[i, j] < shown.mean() else "black")
    ax.set_xticks(range(len(cols)), [str(n) for _, n in cols], fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    kinds = list(dict.fromkeys(k for k, _ in cols))
    for kind in kinds:   # each kind's counts under one label, a line between kinds
        idx = [j for j, (k, _) in enumerate(cols) if k == kind]
        ax.text(sum(idx) / len(idx), -0.6, kind, ha="center", va="bottom", fontsize=9)
        if idx[0]:
            ax.axvline(idx[0] - 0.5, color="white", lw=3)
    ax.set_xlabel("chips of the kind named above")
    fig.colorbar(image, ax=ax, label="log10 steps/s", shrink=0.9)
    ax.set_title(title or "steps/s in the planner's best layout (— : no layout fits)",
                 fontsize=10, pad=16)
    return fig


def _label(ax, row: int, seg, span: float, height: float) -> None:
    """A segment's layout label (real runs) or count, written in its bar where it fits."""
    _, _, count, start, end, *label = seg
    words = label[0] if label else str(count)
    if height >= 0.4 and end - start >= span * (0.012 * len(words) + 0.004):
        ax.text((start + end) / 2, row, words, ha="center", va="center", fontsize=6.5,
                color="white")


def gantt(segments, jobs, ax=None, title: str | None = None, unit: str = "h",
          scale: float = 3600.0, span: float | None = None) -> Figure:
    """segments (job, kind, count, start s, end s[, layout label]): one row a job in arrival
    order, its arrival a black tick and its wait a thin grey line, each segment a bar coloured by
    its kind whose height is its count over the most chips any segment held (at least 0.35), the
    layout label (real runs) or the count written where it fits. Times divided by `scale`, shown
    in `unit`; span: the time axis' end (s), by default the last segment's."""
    order = {j.name: i for i, j in enumerate(order_jobs(jobs))}
    colours = _kind_colours(seg[1] for seg in segments)
    most = max((seg[2] for seg in segments), default=1)
    end = (span or max((seg[4] for seg in segments), default=1.0)) / scale
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.2 + 0.16 * len(order) + 0.25), layout="constrained")
    finish, bars = {}, {}
    for seg in segments:
        finish[seg[0]] = max(finish.get(seg[0], 0.0), seg[4])
        bars.setdefault((order[seg[0]], seg[1], seg[2]), []).append(
            (seg[3] / scale, (seg[4] - seg[3]) / scale))
    ax.hlines(list(order.values()), [j.arrival / scale for j in order_jobs(jobs)],
              [finish.get(j.name, j.arrival) / scale for j in order_jobs(jobs)], color="grey",
              lw=0.6, zorder=0)
    ax.plot([j.arrival / scale for j in order_jobs(jobs)], list(order.values()), "|",
            color="black", ms=5)
    for (row, kind, count), spans in bars.items():   # one call a (job, kind, count): fast
        h = 0.85 * max(0.35, count / most)
        ax.broken_barh(spans, (row - h / 2, h), facecolors=colours[kind], lw=0)
    for seg in segments:
        _label(ax, order[seg[0]], (*seg[:3], seg[3] / scale, seg[4] / scale, *seg[5:]), end,
               0.85 * max(0.35, seg[2] / most))
    many = len(order) > 12
    ax.set_yticks(range(len(order)), [] if many else list(order), fontsize=8)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set(xlabel=f"time ({unit})", ylabel=f"jobs, by arrival ({len(order)})" if many else "")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), fontsize=8, ncols=len(handles), loc="lower right",
              bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    return ax.figure


def order_jobs(jobs) -> list:
    """The jobs in arrival order (the gantt's rows)."""
    return sorted(jobs, key=lambda j: j.arrival)


def held(segments, kind: str, times) -> np.ndarray:
    """Chips of `kind` held at each of `times` (s) by the segments [start, end)."""
    times = np.asarray(times, dtype=float)
    out = np.zeros_like(times)
    for _, k, count, start, end, *_ in segments:
        if k == kind:
            out += count * ((times >= start) & (times < end))
    return out


def occupancy(segments, capacity: dict, ax=None, unit: str = "h", scale: float = 3600.0,
              span: float | None = None) -> Figure:
    """The share of each kind's chips held over time (a step line a kind, its colour the
    gantt's), from time 0 to `span` s (default: the last segment's end)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.2), layout="constrained")
    end = span or max((seg[4] for seg in segments), default=1.0)
    times = np.unique([0.0, end, *(s[3] for s in segments), *(s[4] for s in segments)])
    colours = _kind_colours([*(seg[1] for seg in segments), *capacity])
    for kind, chips in capacity.items():
        ax.step(times / scale, held(segments, kind, times) / chips, where="post", lw=1,
                color=colours[kind], label=f"{kind} ({chips})")
    ax.set(xlabel=f"time ({unit})", ylabel="share held", ylim=(0, 1.05), xlim=(0, end / scale))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncols=len(capacity), loc="lower right")
    return ax.figure


def schedule(result, jobs, title: str | None = None) -> Figure:
    """A Result drawn: its gantt (one row a job) over its occupancy (each kind's share held), on
    one time axis in hours."""
    rows = len(jobs)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 2.6 + 0.13 * rows), sharex=True,
                                      height_ratios=[0.9 + 0.13 * rows, 1.4],
                                      layout="constrained")
    span = max(seg[4] for seg in result.segments)
    gantt(result.segments, jobs, ax=top, span=span,
          title=title or f"{result.policy}: average JCT {result.avg_jct / 3600:.2f} h, "
                         f"utilisation {result.utilization:.0%}")
    occupancy(result.segments, result.capacity, ax=bottom, span=span)
    top.set_xlabel("")
    return fig


def timelines(panels: dict, jobs, unit: str = "s", scale: float = 1.0,
              title: str | None = None) -> Figure:
    """{panel title: segments} drawn as gantts one under the other, on one time axis."""
    span = max(seg[4] for segs in panels.values() for seg in segs)
    n = len(panels)
    fig, axes = plt.subplots(n, 1, figsize=(10, 0.3 + n * (0.9 + 0.3 * len(jobs))), sharex=True,
                             squeeze=False, layout="constrained")
    for ax, (name, segs) in zip(axes[:, 0], panels.items()):
        gantt(segs, jobs, ax=ax, title=name, unit=unit, scale=scale, span=span)
        if ax is not axes[-1, 0]:
            ax.set_xlabel("")
    if title:
        fig.suptitle(title)
    return fig


def jct_cdf(results: dict, ax=None, title: str | None = None) -> Figure:
    """{policy: Result}: the share of jobs done within each JCT (hours, log scale), a step line a
    policy, its average JCT a dot on the line's height at that time."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 3.6), layout="constrained")
    for i, (name, res) in enumerate(results.items()):
        hours = np.sort(np.array(list(res.jct.values())) / 3600)
        share = np.arange(1, len(hours) + 1) / len(hours)
        colour = COLOURS[i % len(COLOURS)]
        ax.step(hours, share, where="post", color=colour, lw=1.4,
                label=f"{name}: average {res.avg_jct / 3600:.1f} h")
        ax.plot(res.avg_jct / 3600, np.searchsorted(hours, res.avg_jct / 3600) / len(hours), "o",
                color=colour, ms=4)
    ax.set_xscale("log")
    ax.set(xlabel="job completion time (h, log)", ylabel="share of jobs done", ylim=(0, 1.02))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "job completion times: each policy's distribution (dot: its average)",
                 fontsize=10)
    return ax.figure


def metrics(result) -> str:
    """A Result's metrics in one line (Result.row())."""
    row = result.row()
    return (f"{row['policy']}: average JCT {row['avg JCT h']:.2f} h, p99 {row['p99 JCT h']:.2f} h, "
            f"makespan {row['makespan h']:.1f} h, utilisation {row['utilization']:.0%}, worst "
            f"rho {row['worst rho']:.2f}, restarts {row['restarts']}, {result.rounds} rounds")


def panel(result, jobs, title: str) -> list:
    """The widget's outputs: `schedule` as a PNG, and `metrics` as text."""
    return [png(schedule(result, jobs, title=title)), text(metrics(result))]
