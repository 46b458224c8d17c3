"""Plots for lesson 00 (collectives): the ring all-reduce stepped
through, and bandwidth against size.

    ring_states(n)        the ring all-reduce simulated from `comm.ring_schedule`: what each rank
                          holds
    ring_steps(n)         that simulation drawn, one ranks x chunks grid per step
    bandwidth(...)        time and bus bandwidth against message size, for several implementations
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
    title = "start" if state["phase"] == "start" else f"{state['phase']} {state['step']}{verb}"
    ax.set_title(title, fontsize=10, pad=14)


def ring_steps(n: int = 4) -> Figure:
    """Draw `ring_states(n)`: reduce-scatter on the top row, all-gather below, one grid per step.

    Rows are ranks, columns are chunks; a cell's colour is how many ranks' contributions it sums and
    its text says whose ("all" = the finished sum; above 4 ranks, only how many). A red box marks
    the chunk each rank received at that step, the red arrow shows it came from the rank above (rank
    0's from the last rank).
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
    legend.text(0.45, 0.5, "red box: the chunk a rank\nreceived at this step\n\narrow: it came "
                           "from the\n"
                f"rank above (rank 0's\nfrom rank {n - 1})", transform=legend.transAxes,
                va="center",
                fontsize=8)
    fig.suptitle(f"Ring all-reduce on {n} ranks: reduce-scatter (top), then all-gather (bottom)")
    return fig


def bandwidth(sizes: list[int], times: dict[str, list[float]], world: int) -> Figure:
    """Time and bus bandwidth of an all-reduce against message size, one line per implementation.

    sizes are in bytes, times[name][i] in seconds for sizes[i]. Bus bandwidth is the rate of the
    bytes each rank must send, 2(N-1)/N * size / time (nccl-tests' definition), so it can be
    compared with a link's bandwidth whatever N is.
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
