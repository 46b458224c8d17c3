"""Plots for lesson 01 (data parallelism): what each rank computed and sent, step by step.

    step_spans(spans)       one rank's measured spans (TrainResult.spans) cut into training steps
    compute_and_comm(runs)  per-rank Gantt chart of compute and communication, one panel per run
    sync_sweep(series)      step, backward and exposed communication against all-reduces per step
"""
from __future__ import annotations

import statistics

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple


def step_spans(spans: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """Cut one rank's spans ((what, start, end), any order) into training steps.

    A step ends with its "wait" span (the time blocked in `GradBuckets.finish()`); the spans
    that start after the previous step's wait ended belong to it. Returns the steps in order, each
    sorted by start time.
    """
    spans = sorted(spans, key=lambda s: s[1])
    ends = sorted(end for what, _, end in spans if what == "wait")
    steps, i = [[] for _ in ends], 0
    for span in spans:
        while i < len(ends) - 1 and span[1] >= ends[i]:
            i += 1
        steps[i].append(span)
    return steps


_COMPUTE = {"forward": "#4C72B0", "backward": "#DD8452", "wait": "#C44E52"}


def compute_and_comm(runs: dict[str, list[list[tuple[str, float, float]]]],
                     title: str = "compute and communication",
                     comm_label: str = "all-reduce") -> Figure:
    """Per-rank Gantt chart, one panel per run ({label: spans by rank}), on one time axis.

    Spans are (what, start, end) in perf_counter seconds, as `GradBuckets.spans` records them
    (TrainResult.spans). Each rank has two rows: "compute" (forward, backward, and "wait", the time
    blocked in finish() on communication backward did not hide, hatched) and "comm" (every
    collective, "bucket i": DP's all-reduces, ZeRO-1/2's reduce-scatters, as `comm_label` names
    them in the legend; neighbours alternate in shade). Times count from each run's first span.
    """
    fig, axes = plt.subplots(len(runs), 1,
                             figsize=(10, 0.5 + 1.1 * sum(len(r) for r in runs.values())),
                             sharex=True, squeeze=False, layout="constrained")
    longest = 0.0  # ms: the shared axis ends with the longest run
    for ax, (label, ranks) in zip(axes[:, 0], runs.items()):
        t0 = min(start for spans in ranks for _, start, _ in spans)
        longest = max(longest, max((end - t0) * 1e3 for spans in ranks for *_, end in spans))
        ticks = []
        for r, spans in enumerate(ranks):
            y_compute, y_comm = 2 * r, 2 * r + 1
            ticks += [(y_compute, f"rank {r} compute"), (y_comm, f"rank {r} comm")]
            comm = sorted((s for s in spans if s[0] not in _COMPUTE), key=lambda s: s[1])
            for i, (what, start, end) in enumerate(comm):
                ax.barh(y_comm, (end - start) * 1e3, left=(start - t0) * 1e3, height=0.7,
                        edgecolor="white",
                        lw=0.3, color="#55A868" if i % 2 == 0 else "#2E7D46")
            for what, start, end in spans:
                if what in _COMPUTE:
                    ax.barh(y_compute, (end - start) * 1e3, left=(start - t0) * 1e3, height=0.7,
                            color=_COMPUTE[what], hatch="//" if what == "wait" else None,
                            edgecolor="white", lw=0.3)
        ax.set_yticks(*zip(*ticks), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, hatch="//" if k == "wait" else None, ec="white")
               for k, c in _COMPUTE.items()]
    handles.append(tuple(plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#55A868", "#2E7D46")))
    axes[0, 0].legend(handles, ["forward", "backward", "wait (blocked in finish)",
                                f"{comm_label} (buckets alternate shades)"],
                      handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
                      fontsize=8, ncols=4, loc="lower right", bbox_to_anchor=(1.0, 1.0))
    axes[-1, 0].set_xlim(0, longest * 1.01)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.suptitle(title)
    return fig


_PHASES = {"step": "step", "backward": "backward", "wait": "exposed communication (wait)"}


def sync_sweep(series: dict[str, list[tuple[int, str, dict]]],
               title: str = "gradient sync: messages and overlap") -> Figure:
    """Median times (ms) with their interquartile range, one panel per phase of `_PHASES`, against
    the all-reduces a step makes (log scale): {series label: [(messages, point label, {phase:
    [seconds per repetition]})]}, e.g. one series for buckets launched after backward and one for
    buckets overlapped with it, a point per bucket size. The first series' point labels are written
    in the first panel; the x ticks are the message counts."""
    fig, axes = plt.subplots(1, len(_PHASES), figsize=(11, 3.4), layout="constrained")
    counts = sorted({m for points in series.values() for m, _, _ in points})
    for k, ((label, points), marker) in enumerate(zip(series.items(), "os^D")):
        points = sorted(points, key=lambda p: p[0])
        for ax, phase in zip(axes, _PHASES):
            ms = [[t * 1e3 for t in times[phase]] for _, _, times in points]
            mid = [statistics.median(t) for t in ms]
            q1, _, q3 = zip(*(statistics.quantiles(t, n=4) for t in ms))
            err = [[m - lo for m, lo in zip(mid, q1)], [hi - m for m, hi in zip(mid, q3)]]
            ax.errorbar([m for m, _, _ in points], mid, yerr=err, marker=marker, capsize=3,
                        label=label)
            if phase == "step" and k == 0:
                for (m, name, _), y in zip(points, mid):
                    last = m == points[-1][0]  # the rightmost: its label goes left, inside the axes
                    ax.annotate(name, (m, y), fontsize=7, xytext=(-6, 4) if last else (5, -10),
                                textcoords="offset points", ha="right" if last else "left")
    for ax, name in zip(axes, _PHASES.values()):
        ax.set_xscale("log")
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.set(xlabel="all-reduces per step (log scale)", ylabel="ms (median, IQR bars)",
               title=name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return fig
