"""Plots for the pipeline lesson (05): each function takes plain
data and returns a matplotlib Figure; and the one worker it launches, `timed_steps`.

    gantts(timelines)          several `pipeline.Timeline`s as Gantt charts (`viz_pipeline.gantt`),
                               one panel each, stacked on one time axis: schedules side by side, or
                               measured over simulated
    in_flight(timeline)        its peak in flight, labelled with its unit (micro-batches, or with
                               interleaving chunk-micro-batches and their stage-equivalents)
    against_m(ms, points)      a quantity against the number of micro-batches m, one colour per
                               series: markers for what was simulated or measured,
                               dashed lines for the formulas
    timed_steps(cfg, layouts)  worker (minipar.launch): train each layout and return every step's
                               pipeline actions with their times, not only the last step's
"""
from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
from matplotlib.figure import Figure


COLOURS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def gantts(timelines: dict, title: str | None = None, sharex: bool = True,
           unit: str | None = None) -> Figure:
    """{panel title: Timeline} drawn one under the other. sharex: one time scale for all (to compare
    lengths: the same costs, or measured against simulated), else each panel fills its width.
    unit: the time axis' unit ("seconds", "cost units"), written in its label."""
    n = len(timelines)
    rows = [0.8 + 0.45 * tl.ranks for tl in timelines.values()]
    fig, axes = plt.subplots(n, 1, figsize=(10, 0.6 * n + sum(rows)), sharex=sharex, squeeze=False,
                             height_ratios=rows, layout="constrained")
    for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
        gantt(tl, ax=ax, title=f"{name}: bubble {tl.bubble:.1%}, {in_flight(tl)}", unit=unit)
        if sharex:
            ax.set_xlim(0, max(t.makespan for t in timelines.values()) or 1)
        if ax is not axes[-1, 0]:
            ax.set_xlabel("")
    if title:
        fig.suptitle(title)
    return fig


def against_m(ms: list[int], points: dict[str, list[float]],
              lines: dict[str, list[float]] | None = None,
              ylabel: str = "", title: str = "", ax=None,
              lines_label: str = "dashed: the formula") -> Figure:
    """points[name][i] (markers) and lines[name][i] (dashed, in the same colour) at m = ms[i]. Each
    series' markers are smaller than the one before, so that series falling
    on the same values all stay visible."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
    names = list(dict.fromkeys([*points, *(lines or {})]))
    for i, name in enumerate(names):
        colour = COLOURS[i % len(COLOURS)]
        if lines and name in lines:
            ax.plot(ms, lines[name], ls="--", lw=1.2, color=colour,
                    label=None if name in points else name)
        if name in points:
            ax.plot(ms, points[name], "o", ms=max(9 - 1.8 * i, 3), color=colour, label=name)
    if lines and any(name in points for name in lines):
        ax.plot([], [], ls="--", color="grey", label=lines_label)
    ax.set(xlabel="micro-batches m", ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_xticks(ms)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax.figure


_PIPELINE = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}



_CHUNK_HATCH = [None, "//", "..", "xx", "\\\\", "++"]



def in_flight(timeline) -> str:
    """The most (chunk, micro-batch) pairs alive on any rank (`Timeline.peak_in_flight`), with its
    unit. With v chunks per rank (interleaving) a pair holds 1/v of a rank's layers, so the count
    is in chunk-micro-batches, and divided by v in stage-equivalents: micro-batches of a whole
    stage, the unit of the other schedules' counts."""
    peaks = timeline.peak_in_flight
    top = max(peaks, default=0)
    v = (1 + max((a.stage for rank in timeline.events for a, _, _ in rank), default=0)) \
        // max(timeline.ranks, 1)
    if v <= 1:
        return f"peak in flight {top} micro-batches"
    return (f"peak in flight {top} chunk-micro-batches of 1/{v} stage = {top / v:g} "
            "stage-equivalents")


def gantt(timeline, ax=None, title: str | None = None, unit: str | None = None) -> Figure:
    """A `pipeline.Timeline` (simulated or measured) drawn: one row per pipeline rank, one box per
    action, coloured by op (F forward, B backward or input gradient, W weight gradient) and labelled
    with its micro-batch; with several chunks per rank, a rank's later chunks are hatched. Grey is
    idle: the bubble."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.8 + 0.45 * timeline.ranks), layout="constrained")
    span, p = timeline.makespan, timeline.ranks
    for r, rank in enumerate(timeline.events):
        ax.barh(r, span, left=0, height=0.8, color="#E6E6E6")  # idle background, covered where busy
        for a, s, e in rank:
            hatch = _CHUNK_HATCH[(a.stage // p) % len(_CHUNK_HATCH)]
            ax.barh(r, e - s, left=s, height=0.8, color=_PIPELINE[a.op], ec="white", lw=0.5,
                    hatch=hatch)
            if e - s >= span / 90:  # label only boxes wide enough to read, clear of the hatch
                ax.text((s + e) / 2, r, str(a.microbatch), ha="center", va="center", color="white",
                        fontsize=7, bbox=dict(boxstyle="square,pad=0.3", fc=_PIPELINE[a.op],
                                              ec="none") if hatch else None)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, span or 1)
    ax.set_xlabel(f"time ({unit or 'the costs simulate was given: by default one F = 1'})")
    ops = [op for op in _PIPELINE
           if any(a.op == op for rank in timeline.events for a, _, _ in rank)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=_PIPELINE[op]) for op in ops]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#E6E6E6"))
    labels = [*ops, "idle"]
    chunks = 1 + max((a.stage // p for rank in timeline.events for a, _, _ in rank), default=0)
    for k in range(1, min(chunks, len(_CHUNK_HATCH))):  # interleaving: which chunk of the rank
        handles.append(plt.Rectangle((0, 0), 1, 1, fc="grey", ec="white", hatch=_CHUNK_HATCH[k]))
        labels.append(f"chunk {k + 1} of a rank")
    ax.legend(handles, labels, fontsize=8, ncols=len(handles), loc="lower right",
              bbox_to_anchor=(1.0, 1.0))
    title = title or f"bubble {timeline.bubble:.1%}, {in_flight(timeline)}"
    ax.set_title(textwrap.fill(title, 80, break_on_hyphens=False), fontsize=10,
                 loc="left")  # wrapped: clear of the legend
    return ax.figure
