"""Plots for lesson 00 (collectives): the ring all-reduce stepped through, and its time against
message size beside the latency-bandwidth (alpha-beta) model fitted to it.

    ring_states(n)        the ring all-reduce simulated from `comm.ring_schedule`: what each rank
                          holds after each step
    ring_steps(n)         that simulation drawn, one ranks x chunks grid per step (at most
                          `max_steps` per phase)
    ring_step(n, step)    one step of it, drawn large; ring_stepper(): sliders over (N, step)
    ring_time(...)        the alpha-beta model of the ring all-reduce's time; fit_ring_time(...)
                          fits alpha and beta to measured times
    bandwidth(...)        measured time and bus bandwidth against size, with the fitted model
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
                    # add the partial sum that arrived
                    new[r][recv] = holds[left][recv] | holds[r][recv]
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
            text = "all" if len(s) == n else "+".join(map(str,
                                                          sorted(s))) if n <= 4 else str(len(s))
            ax.text(c, r, text, ha="center", va="center", fontsize=9 if n <= 3 else 8,
                    color="white" if len(s) > n / 2 else "black")
    for r, (_, recv) in enumerate(state["moves"] or []):
        ax.add_patch(plt.Rectangle((recv - 0.5, r - 0.5), 1, 1, fill=False, lw=2.5, ec="crimson"))
        arrow = dict(arrowstyle="->", color="crimson", lw=1.5)
        x = recv + 0.42
        if r == 0:  # the ring wraps: the last rank sends to rank 0 (out
                    #   of the bottom, in at the top)
            ax.annotate("", (x, -0.45), (x, -0.8), arrowprops=arrow, annotation_clip=False)
            ax.annotate("", (x, n - 0.2), (x, n - 0.55), arrowprops=arrow, annotation_clip=False)
        else:
            ax.annotate("", (x, r - 0.3), (x, r - 0.7), arrowprops=arrow)
    ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=8)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
    ax.tick_params(length=0)
    verb = {"start": "", "reduce-scatter": ": add", "all-gather": ": copy"}[state["phase"]]
    step = f"{state['phase']} {state['step']}/{n - 1}"  # step s of the phase's n-1
    title = "start" if state["phase"] == "start" else f"{step}{verb}"
    ax.set_title(title, fontsize=10, pad=14)


def shown_steps(n: int, max_steps: int = 4) -> list[int]:
    """The steps (from 1) of a phase of n-1 that `ring_steps` draws: all of them up to `max_steps`,
    else the first max_steps-1 and the last (the last completes the phase)."""
    return list(range(1, n)) if n - 1 <= max_steps else [*range(1, max_steps), n - 1]


def ring_steps(n: int = 4, max_steps: int = 4) -> Figure:
    """Draw `ring_states(n)`: start and reduce-scatter on the top row, all-gather below, one grid a
    step; at most `max_steps` steps a phase (`shown_steps`), so that 8 ranks stay legible.

    Rows are ranks, columns are chunks; a cell's colour is how many ranks' contributions it sums and
    its text says whose ("all" = the finished sum; above 4 ranks, only how many). A red box marks
    the chunk each rank received at that step, the red arrow shows it came from the rank above (rank
    0's from the last rank).
    """
    states, steps = ring_states(n), shown_steps(n, max_steps)
    cmap = plt.get_cmap("YlGnBu", n)
    cols = len(steps) + 1
    fig, axes = plt.subplots(2, cols, figsize=(2.6 * cols + 1, 3.0 + 0.44 * n), dpi=120,
                             layout="constrained")
    axes = np.atleast_2d(axes).reshape(2, cols)
    top = [states[0], *(states[s] for s in steps)]
    bottom = [states[n - 1 + s] for s in steps]
    for ax, state in zip([*axes[0], *axes[1]], top + bottom):
        _draw_state(ax, state, n, cmap)
    legend = axes[1, -1]
    legend.axis("off")
    bar = fig.colorbar(plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0.5, n + 0.5)),
                       cax=legend.inset_axes([0.0, 0.05, 0.08, 0.9]), ticks=range(1, n + 1))
    bar.set_label("contributions summed", fontsize=9)
    skipped = f"\n\nsteps {steps[-2] + 1}-{n - 2} of each\nphase not drawn" if len(steps) < n - 1 \
        else ""
    legend.text(0.45, 0.5, "red box: the chunk a rank\nreceived at this step\n\narrow: it came "
                f"from the\nrank above (rank 0's\nfrom rank {n - 1}){skipped}",
                transform=legend.transAxes, va="center", fontsize=8)
    fig.suptitle(f"Ring all-reduce on {n} ranks: reduce-scatter (top), then all-gather (bottom)")
    return fig


def ring_step(n: int, step: int) -> Figure:
    """One state of `ring_states(n)`, drawn large: step 0 is the start, 1..n-1 reduce-scatter,
    n..2(n-1) all-gather."""
    step = min(max(step, 0), 2 * (n - 1))
    cmap = plt.get_cmap("YlGnBu", n)
    fig, ax = plt.subplots(figsize=(4.2 + 0.25 * n, 3.2 + 0.25 * n), dpi=120, layout="constrained")
    _draw_state(ax, ring_states(n)[step], n, cmap)
    bar = fig.colorbar(plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0.5, n + 0.5)), ax=ax,
                       ticks=range(1, n + 1))
    bar.set_label("contributions summed", fontsize=9)
    fig.suptitle(f"{n} ranks, step {step} of {2 * (n - 1)}", fontsize=10)
    return fig


def ring_stepper(n: int = 4, max_n: int = 8):
    """Sliders over the number of ranks and the step, drawing `ring_step(N, step)`: no processes,
    the states are simulated. Needs a live kernel; a saved page shows `ring_steps` instead."""
    import ipywidgets as widgets  # here only: the figures above need no widgets
    from IPython.display import display

    ranks = widgets.IntSlider(value=n, min=2, max=max_n, description="ranks N",
                              continuous_update=False)
    step = widgets.IntSlider(value=0, min=0, max=2 * (n - 1), description="step")
    ranks.observe(lambda change: setattr(step, "max", 2 * (change["new"] - 1)), "value")

    def draw(n: int, step: int) -> None:
        fig = ring_step(n, step)
        display(fig)
        plt.close(fig)

    return widgets.interactive(draw, n=ranks, step=step)


def ring_time(alpha: float, beta: float, size, n):
    """The alpha-beta model of the ring all-reduce, in seconds: 2(N-1) steps of latency alpha
    (seconds) each, and the 2(N-1)/N * size bytes a rank sends at bandwidth beta (bytes/second):
    T = 2(N-1) alpha + 2(N-1)/N * size / beta. size and n may be numpy arrays."""
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * np.asarray(size) / beta


def fit_ring_time(size, n, seconds) -> tuple[float, float]:
    """(alpha, beta) of `ring_time` fitted to measured points (arrays of size in bytes, N, seconds)
    by linear least squares in (alpha, 1/beta) on the relative error: each equation is divided by
    its measured time, so a 4 KB point weighs as much as a 64 MB one (plain least squares would fit
    the biggest times alone). A coefficient that comes out negative is set to 0 and the other one
    refitted (alpha = 0 means no latency was seen; beta = inf no bandwidth limit)."""
    size, n, t = (np.asarray(v, dtype=float) for v in (size, n, seconds))
    a = np.stack([2 * (n - 1), 2 * (n - 1) / n * size], axis=1) / t[:, None]
    coef = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
    if (coef < 0).any():
        keep = int(np.argmax(coef))
        coef = np.zeros(2)
        coef[keep] = np.linalg.lstsq(a[:, keep:keep + 1], np.ones_like(t), rcond=None)[0][0]
    return float(coef[0]), float(1 / coef[1]) if coef[1] > 0 else float("inf")


def bandwidth(sizes: list[int], samples: dict[int, list[list[float]]], alpha: float, beta: float,
              others: dict[int, list[float]] | None = None, other: str = "") -> Figure:
    """Measured all-reduce times against size beside `ring_time(alpha, beta)`, one colour per N.

    samples[n][i]: the seconds measured for sizes[i] (bytes) on n ranks, drawn as their median with
    a bar from min to max; others[n][i]: another implementation's median (`other` names it), drawn
    as crosses. Left: time (ms); right: bus bandwidth, 2(N-1)/N * size / time (nccl-tests'
    definition: the rate of the bytes each rank sends, comparable across N), which the model says
    rises towards beta. A diamond on each model line marks size = N alpha beta, where the latency
    term equals the bandwidth term.
    """
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120, layout="constrained")
    line = np.geomspace(sizes[0] / 2, sizes[-1] * 2, 200)
    for n, colour in zip(samples, plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        ts = [np.asarray(t) for t in samples[n]]
        med = np.array([np.median(t) for t in ts])
        err = np.array([med - [t.min() for t in ts], [t.max() for t in ts] - med])
        sent = 2 * (n - 1) / n * np.asarray(sizes) / 1e9  # 10^9 bytes a rank sends, per size
        ax_t.errorbar(sizes, med * 1e3, err * 1e3, fmt="o", color=colour, capsize=3,
                      label=f"N={n} measured")
        ax_b.errorbar(sizes, sent / med, [sent / med - sent / (med + err[1]),
                                          sent / (med - err[0]) - sent / med],
                      fmt="o", color=colour, capsize=3, label=f"N={n} measured")
        model = ring_time(alpha, beta, line, n)
        ax_t.plot(line, model * 1e3, "-", color=colour, alpha=0.7, label=f"N={n} model")
        ax_b.plot(line, 2 * (n - 1) / n * line / model / 1e9, "-", color=colour, alpha=0.7)
        cross = n * alpha * beta
        if line[0] <= cross <= line[-1]:
            ax_t.plot(cross, ring_time(alpha, beta, cross, n) * 1e3, "D", mfc="white", color=colour)
        if others and n in others:
            ax_t.plot(sizes, np.asarray(others[n]) * 1e3, "x", color=colour, ms=7,
                      label=f"N={n} {other}")
    ax_b.axhline(beta / 1e9, color="gray", ls="--", lw=1, label=f"β = {beta / 1e9:.2f} GB/s")
    for ax, label in ((ax_t, "time (ms)"), (ax_b, "bus bandwidth (GB/s, 10⁹ bytes/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_bytes(s) for s in sizes], fontsize=8)
        ax.set_xlabel("message size (bytes; all-reduce of fp32)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_t.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax_t.yaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(f"minipar's ring all-reduce: median (bars: min to max) and the α–β model, "
                 f"α = {alpha * 1e6:.0f} µs, β = {beta / 1e9:.2f} GB/s (diamond: size = Nαβ)")
    return fig


def _bytes(n: int) -> str:
    """A byte count as people say it: 4096 -> "4 KB", 2**20 -> "1 MB" (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g} {unit}"
        n /= 1024
