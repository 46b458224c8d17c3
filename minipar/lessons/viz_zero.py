"""Plots for lesson 03 (ZeRO): model states against N_d, memory over a step, stage 3's gathers.

    zero_stages(table)    model states per device against N_d, per ZeRO stage (the paper's Table I)
    step_memory(...)      live bytes by category over one training step, one panel per layout
                          (lessons 01 and 02 draw their steps with it too)
    gather_timeline(...)  ZeRO-3's gathers and frees over one step (`demos.zero3_trace` records
                          them), and the gathered bytes held
    gather_exposure(rows) each all-gather's time and the compute's wait for it, predicted beside
                          measured (`demos_zero.gather_rows`)
"""
from __future__ import annotations


import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from minipar.memory import CATEGORIES


def zero_stages(table: dict[int, dict[int, float]], paper: dict[int, tuple] | None = None,
                title: str = "model states per device") -> Figure:
    """GB per device against N_d, one bar per ZeRO stage ({N_d: {stage: GB}}, as `memory.zero_table`
    gives), on a log scale; `paper` ({N_d: (stage 1, 2, 3)}) adds the
    published figures as black ticks."""
    n_ds, stages = list(table), sorted(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(1.5 + 1.3 * len(n_ds), 3.8), layout="constrained")
    w = 0.8 / len(stages)
    for k, stage in enumerate(stages):
        xs = np.arange(len(n_ds)) + (k - (len(stages) - 1) / 2) * w
        gb = [table[n][stage] for n in n_ds]
        ax.bar(xs, gb, w, label="DP (stage 0)" if stage == 0 else f"ZeRO-{stage}")
        for x, v in zip(xs, gb):
            ax.text(x, v, f"{v * (1 + 1e-12):.3g}", ha="center", va="bottom", fontsize=7)  # half up
        if paper and stage > 0:
            ax.plot(xs, [paper[n][stage - 1] for n in n_ds], "k_", ms=12, mew=2,
                    label="the paper" if stage == 1 else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(n_ds)), [f"N_d = {n}" for n in n_ds])
    ax.set(ylabel="GB per device", title=title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def held_peak(timeline: list) -> tuple[int, int]:
    """(index in `timeline`, bytes) of its fullest sample without "temporaries": the "held" peak
    (the first of equals, as the Tracker keeps it). timeline: Tracker.timeline, as
    TrainResult.memory_timelines[rank] gives it."""
    held = [sum(v for c, v in live.items() if c != "temporaries") for _, _, live in timeline]
    i = held.index(max(held))
    return i, held[i]


def step_memory(timelines: dict[str, list], predicted: dict | None = None, ncols: int = 3,
                title: str = "memory over one training step") -> Figure:
    """One training step's live bytes by category, stacked (MiB), one panel per layout ({label:
    timeline}, each a Tracker.timeline: [(event, phase, {category: bytes})]), against the event
    index (each allocation, free or phase change is an event); "temporaries" (autograd's and the
    optimizer's scratch) on top, grey. The phases are marked; a white dot is the measured "held"
    peak (every category but temporaries); predicted ({label: total bytes}, None or absent where
    there is no prediction) is a dashed black line. The panels share the y axis."""
    colours = dict(zip(CATEGORIES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    colours["temporaries"] = "#BBBBBB"
    rows = -(-len(timelines) // ncols)
    cols = min(ncols, len(timelines))
    fig, axes = plt.subplots(rows, cols, figsize=(0.8 + 3.6 * cols, 0.6 + 2.6 * rows), sharey=True,
                             squeeze=False, layout="constrained")
    for ax, (label, timeline) in zip(axes.flat, timelines.items()):
        events = [e for e, _, _ in timeline]
        order = [c for c in (*CATEGORIES, "temporaries") if c in timeline[0][2]]
        stacks = [[live[c] / 2**20 for _, _, live in timeline] for c in order]
        ax.stackplot(events, stacks, colors=[colours[c] for c in order], step="post", lw=0)
        for k, (e, phase, _) in enumerate(timeline):
            if phase and (k == 0 or timeline[k - 1][1] != phase):
                ax.axvline(e, color="k", lw=0.6, ls=":")
                ax.text(e, 1.0, f" {phase}", transform=ax.get_xaxis_transform(), fontsize=7,
                        va="top")
        i, held = held_peak(timeline)
        ax.plot(events[i], held / 2**20, "o", mfc="white", mec="k", ms=5)
        if predicted and predicted.get(label) is not None:
            ax.axhline(predicted[label] / 2**20, color="k", ls="--", lw=0.9)
        ax.set_title(f"{label}: held peak {held / 2**20:.2f} MiB", fontsize=9, loc="left")
        ax.set_xlabel("event", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(timelines):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("MiB live")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[c]) for c in (*CATEGORIES, "temporaries")]
    handles += [plt.Line2D([], [], marker="o", mfc="white", mec="k", ls=""),
                plt.Line2D([], [], color="k", ls="--", lw=0.9)]
    fig.legend(handles, [*CATEGORIES, "temporaries", "measured held peak", "predicted held peak"],
               fontsize=7, loc="outside lower center", ncols=8)
    fig.suptitle(title)
    return fig


def gather_timeline(trace: dict, predicted_peak: int | None = None,
                    title: str = "ZeRO-3: when each unit's parameters are gathered") -> Figure:
    """A `demos.zero3_trace` drawn. Top: one row per unit, a bar from the
    launch of its all-gather to its free (blue in forward, orange in backward), hatched red where
    the compute waited for it. Bottom: the gathered bytes held over time (MiB, against ms since the
    step began), with `predicted_peak` as a dashed line if given."""
    t0 = trace["phases"][0][1]
    ms = lambda t: (t - t0) * 1e3
    units = trace["units"]
    backward_start = next(start for what, start, _ in trace["phases"] if what == "backward")
    fig, (ax, ax_b) = plt.subplots(2, 1, figsize=(10, 1.5 + 0.3 * len(units) + 1.8), sharex=True,
                                   height_ratios=[len(units), 6], layout="constrained")
    opened = {}
    for what, i, t, _ in trace["events"]:
        if what == "gather":
            opened[i] = t
        elif i in opened:
            start = opened.pop(i)
            ax.barh(i, ms(t) - ms(start), left=ms(start), height=0.6,
                    color="#4C72B0" if start < backward_start else "#DD8452")
    for i, start, end in trace["waits"]:
        ax.barh(i, ms(end) - ms(start), left=ms(start), height=0.6, fill=False, hatch="///",
                ec="#C44E52", lw=0)
    for what, start, end in trace["phases"]:
        ax.axvline(ms(start), color="grey", lw=0.8, ls=":")
        ax.text(ms(start), -0.9, f" {what}", fontsize=8, color="grey")
    ax.set_yticks(range(len(units)), units, fontsize=8)
    ax.set_ylim(len(units) - 0.5, -1.2)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4C72B0", "#DD8452")]
    handles.append(plt.Rectangle((0, 0), 1, 1, fill=False, hatch="///", ec="#C44E52"))
    ax.legend(handles, ["gathered in forward", "gathered in backward", "compute waits for it"],
              fontsize=8, ncols=3, loc="lower right", bbox_to_anchor=(1.0, 1.0))
    steps = [(ms(t0), 0)] + [(ms(t), b) for _, _, t, b in trace["events"]]
    ax_b.step([x for x, _ in steps], [b / 2**20 for _, b in steps], where="post", color="#55A868")
    if predicted_peak is not None:
        ax_b.axhline(predicted_peak / 2**20, color="k", ls="--", lw=1, label="predicted peak")
        ax_b.legend(fontsize=8, loc="upper right")
    ax_b.set(xlabel="time since the step began (ms)", ylabel="gathered (MiB)")
    ax_b.grid(alpha=0.3)
    fig.suptitle(title)
    return fig


def gather_exposure(rows: list[dict], title: str = "ZeRO-3: each all-gather, predicted and "
                    "measured") -> Figure:
    """`demos_zero.gather_rows` drawn, one group of bars per all-gather of the step (F: forward,
    B: backward). Top: the all-gather's time, predicted (alpha-beta) and measured (median, bar
    from min to max). Bottom: how long the compute waited for it, predicted and measured."""
    x = np.arange(len(rows))
    labels = [f"{r['phase'][0].upper()} {r['unit']}" for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True, layout="constrained")
    for ax, key, pred, what in ((axes[0], "gather", "predicted", "all-gather (ms)"),
                                (axes[1], "exposed", "exposed_predicted", "compute waited (ms)")):
        meas = np.array([r[key] for r in rows]) * 1e3
        spread = np.array([[r[key] - r[key + "_spread"][0], r[key + "_spread"][1] - r[key]]
                           for r in rows]).T * 1e3
        ax.bar(x - 0.2, [r[pred] * 1e3 for r in rows], 0.4, color="#BBBBBB", hatch="//",
               label="predicted")
        ax.bar(x + 0.2, meas, 0.4, yerr=spread, capsize=2, color="#4C72B0",
               label="measured (median, min-max)")
        ax.set_ylabel(what)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[1].set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    axes[1].set_xlabel("all-gather (F: before a forward, B: before a backward)")
    fig.suptitle(title)
    return fig
