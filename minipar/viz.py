"""Plots for the lessons: each function takes plain data and returns a matplotlib Figure.

Nothing here starts processes or needs a display: the figures draw with any backend (inline in a
notebook, Agg on a headless machine), and `fig.savefig(path)` writes them to a file.

    ring_states(n)        the ring all-reduce simulated from `comm.ring_schedule`: what each rank holds
    ring_steps(n)         that simulation drawn, one ranks x chunks grid per step
    bandwidth(...)        time and bus bandwidth against message size, for several implementations
    loss_curve(runs)      loss against step for several runs, overlaid
    step_spans(timeline)  a DataParallel timeline cut into training steps
    timeline(runs)        per-rank Gantt chart of compute and communication, one panel per run
    memory_bars(runs)     per-rank memory by category, stacked bars, one bar per run
    memory_compare(...)   predicted next to measured memory by category, with their ratio
    zero_stages(table)    model states per device against N_d for the ZeRO stages (the paper's Table I)
    gather_timeline(...)  ZeRO-3's gathers and frees over one step, and the gathered bytes held
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from minipar import comm


def ring_states(n: int) -> list[dict]:
    """Simulate the ring all-reduce on n ranks from its schedule alone, with no processes.

    Returns one state per step, the start first: {"phase", "step", "holds", "moves"}, where
    holds[r][c] is the frozenset of ranks whose chunk c is summed into rank r's copy of chunk c,
    and moves[r] is rank r's (chunk sent right, chunk received from the left) at that step (None
    at the start). Reduce-scatter adds what arrives; all-gather overwrites with it.
    """
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states = [{"phase": "start", "step": 0, "holds": holds, "moves": None}]
    for phase in ("reduce-scatter", "all-gather"):
        for step, moves in enumerate(comm.ring_schedule(n, phase), start=1):
            new = [list(row) for row in holds]
            for r, (_, recv) in enumerate(moves):
                left = (r - 1) % n
                assert moves[left][0] == recv, "the left neighbour must send the chunk r receives"
                if phase == "reduce-scatter":
                    new[r][recv] = holds[left][recv] | holds[r][recv]  # add the partial sum that arrived
                else:
                    new[r][recv] = holds[left][recv]  # take the finished chunk
            holds = new
            states.append({"phase": phase, "step": step, "holds": holds, "moves": moves})
    return states


def _draw_state(ax, state: dict, n: int, cmap) -> None:
    """One ranks x chunks grid: colour = contributions summed, text = whose, arrows = what moved."""
    counts = np.array([[len(s) for s in row] for row in state["holds"]])
    ax.imshow(counts, cmap=cmap, vmin=0.5, vmax=n + 0.5, aspect="auto")
    for r, row in enumerate(state["holds"]):
        for c, s in enumerate(row):  # whose contributions, or only how many when that gets too long
            text = "all" if len(s) == n else "+".join(map(str, sorted(s))) if n <= 4 else str(len(s))
            ax.text(c, r, text, ha="center", va="center", fontsize=9 if n <= 3 else 8,
                    color="white" if len(s) > n / 2 else "black")
    for r, (_, recv) in enumerate(state["moves"] or []):
        ax.add_patch(plt.Rectangle((recv - 0.5, r - 0.5), 1, 1, fill=False, lw=2.5, ec="crimson"))
        arrow = dict(arrowstyle="->", color="crimson", lw=1.5)
        x = recv + 0.42
        if r == 0:  # the ring wraps: the last rank sends to rank 0 (out of the bottom, in at the top)
            ax.annotate("", (x, -0.45), (x, -0.8), arrowprops=arrow, annotation_clip=False)
            ax.annotate("", (x, n - 0.2), (x, n - 0.55), arrowprops=arrow, annotation_clip=False)
        else:
            ax.annotate("", (x, r - 0.3), (x, r - 0.7), arrowprops=arrow)
    ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=8)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
    ax.tick_params(length=0)
    verb = {"start": "", "reduce-scatter": ": add", "all-gather": ": copy"}[state["phase"]]
    title = "start" if state["phase"] == "start" else f"{state['phase']} {state['step']}{verb}"
    ax.set_title(title, fontsize=10, pad=14)


def ring_steps(n: int = 4) -> Figure:
    """Draw `ring_states(n)`: reduce-scatter on the top row, all-gather below, one grid per step.

    Rows are ranks, columns are chunks; a cell's colour is how many ranks' contributions it sums and
    its text says whose ("all" = the finished sum; above 4 ranks, only how many). A red box marks the
    chunk each rank received at that step, the red arrow shows it came from the rank above (rank 0's
    from the last rank).
    """
    states = ring_states(n)
    cmap = plt.get_cmap("YlGnBu", n)
    fig, axes = plt.subplots(2, n, figsize=(max(8.0, 2.6 * n + 1), 4.8), layout="constrained")
    axes = np.atleast_2d(axes).reshape(2, n)
    for ax, state in zip([*axes[0], *axes[1]], states):
        _draw_state(ax, state, n, cmap)
    legend = axes[1, -1]
    legend.axis("off")
    bar = fig.colorbar(plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0.5, n + 0.5)),
                       cax=legend.inset_axes([0.0, 0.05, 0.08, 0.9]), ticks=range(1, n + 1))
    bar.set_label("contributions summed", fontsize=9)
    legend.text(0.45, 0.5, f"red box: the chunk a rank\nreceived at this step\n\narrow: it came from the\n"
                f"rank above (rank 0's\nfrom rank {n - 1})", transform=legend.transAxes, va="center",
                fontsize=8)
    fig.suptitle(f"Ring all-reduce on {n} ranks: reduce-scatter (top), then all-gather (bottom)")
    return fig


def bandwidth(sizes: list[int], times: dict[str, list[float]], world: int) -> Figure:
    """Time and bus bandwidth of an all-reduce against message size, one line per implementation.

    sizes are in bytes, times[name][i] in seconds for sizes[i]. Bus bandwidth is the rate of the
    bytes each rank must send, 2(N-1)/N * size / time (nccl-tests' definition), so it can be compared
    with a link's bandwidth whatever N is.
    """
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for name, ts in times.items():
        ts = np.asarray(ts)
        ax_t.plot(sizes, ts * 1e3, "o-", label=name)
        ax_b.plot(sizes, 2 * (world - 1) / world * np.asarray(sizes) / ts / 1e9, "o-", label=name)
    for ax, label in ((ax_t, "time (ms)"), (ax_b, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_bytes(s) for s in sizes])
        ax.set_xlabel("message size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_t.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax_t.yaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(f"all-reduce on {world} ranks")
    return fig


def _bytes(n: int) -> str:
    """A byte count as people say it: 4096 -> "4 KB", 2**20 -> "1 MB" (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g} {unit}"
        n /= 1024


def loss_curve(runs: dict[str, list[float]], title: str = "training loss") -> Figure:
    """Loss against step, one line per run ({label: losses}); equal runs draw on top of each other."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (label, losses), style in zip(runs.items(), ["-", "--", ":", "-."] * len(runs)):
        ax.plot(range(1, len(losses) + 1), losses, style, label=label)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def step_spans(timeline: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """Cut one rank's timeline ((what, start, end) spans, any order) into training steps.

    A step ends with its "wait" span (the time blocked in `DataParallel.finish()`); the spans that
    start after the previous step's wait ended belong to it. Returns the steps in order, each sorted
    by start time.
    """
    spans = sorted(timeline, key=lambda s: s[1])
    ends = sorted(end for what, _, end in spans if what == "wait")
    steps, i = [[] for _ in ends], 0
    for span in spans:
        while i < len(ends) - 1 and span[1] >= ends[i]:
            i += 1
        steps[i].append(span)
    return steps


_COMPUTE = {"forward": "#4C72B0", "backward": "#DD8452", "wait": "#C44E52"}


def timeline(runs: dict[str, list[list[tuple[str, float, float]]]], title: str = "compute and communication",
             ) -> Figure:
    """Per-rank Gantt chart, one panel per run ({label: spans by rank}), on one time axis.

    Spans are (what, start, end) in perf_counter seconds, as `DataParallel.timeline` records them.
    Each rank has two rows: "compute" (forward, backward, and "wait", the time blocked in finish()
    on communication backward did not hide, hatched) and "comm" (every all-reduce: "bucket i" or, in
    naive mode, "all-reduce"; neighbours alternate in shade). Times count from each run's first span.
    """
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 0.5 + 1.1 * sum(len(r) for r in runs.values())),
                             sharex=True, squeeze=False, layout="constrained")
    for ax, (label, ranks) in zip(axes[:, 0], runs.items()):
        t0 = min(start for spans in ranks for _, start, _ in spans)
        ticks = []
        for r, spans in enumerate(ranks):
            y_compute, y_comm = 2 * r, 2 * r + 1
            ticks += [(y_compute, f"rank {r} compute"), (y_comm, f"rank {r} comm")]
            comm = sorted((s for s in spans if s[0] not in _COMPUTE), key=lambda s: s[1])
            for i, (what, start, end) in enumerate(comm):
                ax.barh(y_comm, (end - start) * 1e3, left=(start - t0) * 1e3, height=0.7, edgecolor="white",
                        lw=0.3, color="#55A868" if i % 2 == 0 else "#2E7D46")
            for what, start, end in spans:
                if what in _COMPUTE:
                    ax.barh(y_compute, (end - start) * 1e3, left=(start - t0) * 1e3, height=0.7,
                            color=_COMPUTE[what], hatch="//" if what == "wait" else None,
                            edgecolor="white", lw=0.3)
        ax.set_yticks(*zip(*ticks), fontsize=8)
        ax.set_xlim(left=0)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, hatch="//" if k == "wait" else None, ec="white")
               for k, c in _COMPUTE.items()] + [plt.Rectangle((0, 0), 1, 1, color="#55A868")]
    axes[0, 0].legend(handles, ["forward", "backward", "wait (blocked in finish)", "all-reduce"],
                      fontsize=8, ncols=4, loc="lower right", bbox_to_anchor=(1.0, 1.0))
    axes[-1, 0].set_xlabel("time (ms)")
    fig.suptitle(title)
    return fig


def memory_bars(runs: dict[str, list[dict]], title: str = "memory per rank") -> Figure:
    """Stacked bars of memory by category ({label: peak memory by rank, {category: bytes}}), MiB.

    One bar per run, for its fullest rank; categories in `memory.CATEGORIES` order, others after.
    """
    from minipar.memory import CATEGORIES

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
    from minipar.memory import CATEGORIES

    colours = dict(zip(CATEGORIES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    width = max(len(runs) for runs in panels.values())
    fig, axes = plt.subplots(1, len(panels), figsize=(1.5 + 1.2 * width * len(panels), 4.0), sharey=True,
                             squeeze=False, layout="constrained")
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
            ax.text(x, max(total) / 2**20, f"×{total[1] / total[0]:.3f}", ha="center", va="bottom",
                    fontsize=8)
        ax.set_xticks(range(len(runs)), list(runs), fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("MiB per rank (left: predicted, right: measured)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[c]) for c in CATEGORIES]
    handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", ec="grey", hatch="//"))
    axes[0, -1].legend(handles, [*CATEGORIES, "predicted"], fontsize="small", loc="upper left",
                       bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    return fig


def zero_stages(table: dict[int, dict[int, float]], paper: dict[int, tuple] | None = None,
                title: str = "model states per device") -> Figure:
    """GB per device against N_d, one bar per ZeRO stage ({N_d: {stage: GB}}, as `memory.zero_table`
    gives), on a log scale; `paper` ({N_d: (stage 1, 2, 3)}) adds the published figures as black ticks."""
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


def gather_timeline(trace: dict, predicted_peak: int | None = None,
                    title: str = "ZeRO-3: when each unit's parameters are gathered") -> Figure:
    """A `demos.zero3_trace` drawn. Top: one row per unit, a bar from the launch of its all-gather to
    its free (blue in forward, orange in backward), hatched red where the compute waited for it.
    Bottom: the gathered bytes held over time, with `predicted_peak` as a dashed line if given."""
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
    ax_b.set(xlabel="time (ms)", ylabel="gathered (MiB)")
    ax_b.grid(alpha=0.3)
    fig.suptitle(title)
    return fig


_PIPELINE = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
_CHUNK_HATCH = [None, "//", "..", "xx", "\\\\", "++"]


def gantt(timeline, ax=None, title: str | None = None) -> Figure:
    """A `pipeline.Timeline` (simulated or measured) drawn: one row per pipeline rank, one box per action,
    coloured by op (F forward, B backward or input gradient, W weight gradient) and labelled with its
    micro-batch; with several chunks per rank, a rank's later chunks are hatched. Grey is idle: the bubble."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.8 + 0.45 * timeline.ranks), layout="constrained")
    span, p = timeline.makespan, timeline.ranks
    for r, rank in enumerate(timeline.events):
        ax.barh(r, span, left=0, height=0.8, color="#E6E6E6")  # idle background, covered where busy
        for a, s, e in rank:
            ax.barh(r, e - s, left=s, height=0.8, color=_PIPELINE[a.op], ec="white", lw=0.5,
                    hatch=_CHUNK_HATCH[(a.stage // p) % len(_CHUNK_HATCH)])
            if e - s >= span / 150:  # label only boxes wide enough to read
                ax.text((s + e) / 2, r, str(a.microbatch), ha="center", va="center", color="white",
                        fontsize=7 if e - s >= span / 60 else 5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, span or 1)
    ax.set_xlabel("time")
    ops = [op for op in _PIPELINE if any(a.op == op for rank in timeline.events for a, _, _ in rank)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=_PIPELINE[op]) for op in ops]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#E6E6E6"))
    ax.legend(handles, [*ops, "idle"], fontsize=8, ncols=len(handles), loc="lower right", bbox_to_anchor=(1.0, 1.0))
    peaks = timeline.peak_in_flight
    ax.set_title(title or f"bubble {timeline.bubble:.1%}, peak in flight {max(peaks, default=0)}", fontsize=10,
                 loc="left")
    return ax.figure
