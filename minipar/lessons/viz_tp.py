"""Plots for the tensor-parallel lesson (04): each function takes plain data and returns a Figure.

    splits(t)                      Megatron's cuts drawn: the MLP's A by columns and B by rows,
                                   attention by heads
    loss_differences(ref, runs)    each layout's |loss - one process's| by step, log scale, beside
                                   the tolerance and float32's rounding step
    activation_bars(runs)          predicted activation memory by part beside the measured total
    comm_compute(ratios, degrees)  TP's communication time over its compute time, per link, by t
    block_timing(widths)           a TP block's forward + backward measured: collectives and the
                                   rest, median and quartiles, ms
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

RANK_COLOURS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
WHOLE = "#BBBBBB"  # a tensor every rank holds whole


def _matrix(ax, x, y, w, h, t, cut, label, names=None, lines=0):
    """A w x h matrix at (x, y), cut into t blocks by "cols" or "rows" ("none": whole, grey), block
    r in rank r's colour, named names[r]; `lines` thinner cuts per block (the heads)."""
    for r in range(t if cut != "none" else 1):
        bx, by, bw, bh = (x + r * w / t, y, w / t, h) if cut == "cols" else \
            (x, y + (t - 1 - r) * h / t, w, h / t) if cut == "rows" else (x, y, w, h)
        ax.add_patch(plt.Rectangle((bx, by), bw, bh, fc=WHOLE if cut == "none" else RANK_COLOURS[r],
                                   alpha=0.75, ec="black", lw=1))
        for k in range(1, lines):
            ax.plot([bx + k * bw / lines] * 2, [by, by + bh], color="white", lw=0.8)
        if names and min(bw, bh) >= 0.3:  # named where the name fits
            ax.text(bx + bw / 2, by + bh / 2, names[r], ha="center", va="center", fontsize=9,
                    weight="bold")
    ax.text(x + w / 2, y - 0.12, label, ha="center", va="top", fontsize=8)


def _op(ax, x, y, text, size=12):
    ax.text(x, y, text, ha="center", va="center", fontsize=size)


def splits(t: int = 2, heads: int = 4) -> Figure:
    """Which rank holds which block. Top, the MLP Z = GeLU(X A) B: A = [A_1 | ... | A_t] by columns,
    B = [B_1; ...; B_t] by rows, so rank r computes Z_r = GeLU(X A_r) B_r alone and g sums the Z_r.
    Bottom, attention: W_q, W_k, W_v by columns, a whole number of heads (`heads` in all) per rank,
    each rank's heads attend alone, W_o by rows, g sums. f and g mark where the ranks meet."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5.0), layout="constrained")
    sub = [f"$_{{{r}}}$" for r in range(t)]  # blocks numbered by the rank that holds them, from 0
    # the MLP: X (s x h), A (h x 4h), Y (s x 4h), B (4h x h), Z (s x h) summed
    _matrix(top, 0.0, 0.5, 1.0, 1.2, 1, "none", "X  (bs × h)\nwhole on every rank")
    _op(top, 1.35, 1.1, "f →", 11)
    _matrix(top, 1.7, 0.8, 2.4, 0.6, t, "cols", "A  (h × 4h)\nby columns", [f"A{s}" for s in sub])
    _op(top, 4.65, 1.1, "→ GeLU →", 9)
    _matrix(top, 5.2, 0.5, 2.4, 1.2, t, "cols", "Y = GeLU(X A)\nrank r: Y_r, no communication",
            [f"Y{s}" for s in sub])
    _op(top, 7.9, 1.1, "×")
    _matrix(top, 8.2, 0.0, 0.6, 2.4, t, "rows", "B  (4h × h)\nby rows", [f"B{s}" for s in sub])
    _op(top, 9.3, 1.1, "→ g →", 10)
    for r in range(t):  # the partial outputs, stacked like a sum, each one's name clear of the next
        x, y = 9.8 + 0.25 * r, 0.5 + 0.3 * (t - 1 - r)
        top.add_patch(plt.Rectangle((x, y), 1.0, 1.0, fc=RANK_COLOURS[r], alpha=0.9, ec="black"))
        top.text(x + 0.1, y + 0.86, f"Z{sub[r]}", fontsize=8, weight="bold", va="center")
    top.text(10.4, 0.38, "Z = Σ Z_r\nall-reduced", ha="center", va="top", fontsize=8)
    top.set_title("MLP:  Z = GeLU(X A) B", fontsize=10, loc="left")
    # attention: W_q, W_k, W_v (h x h) by heads, the heads, W_o (h x h) by rows
    _matrix(bottom, 0.0, 0.5, 1.0, 1.2, 1, "none", "X  (bs × h)")
    _op(bottom, 1.4, 1.1, "f →", 11)
    for i, name in enumerate(("q", "k", "v")):
        _matrix(bottom, 1.8 + 1.15 * i, 0.6, 1.0, 1.0, t, "cols", f"W_{name}  (h × h)",
                [f"{name.upper()}{s}" for s in sub], lines=heads // t)
    _op(bottom, 5.4, 1.1, "→", 12)
    per = heads // t
    for k in range(heads):
        r = k // per
        bottom.add_patch(plt.Rectangle((5.7 + 0.45 * k, 0.75), 0.38, 0.7, fc=RANK_COLOURS[r],
                                       alpha=0.75, ec="black"))
        bottom.text(5.89 + 0.45 * k, 1.1, f"h{k}", ha="center", va="center", fontsize=8)
    bottom.text(5.7 + 0.45 * heads / 2, 0.62,
                f"softmax(q kᵀ/√d) v\nper head h0..h{heads - 1}:\nrank r's, no communication",
                ha="center", va="top", fontsize=8)
    x_o = 6.1 + 0.45 * heads
    _matrix(bottom, x_o, 0.5, 1.2, 1.2, t, "rows", "W_o  (h × h)\nby rows", [f"O{s}" for s in sub])
    _op(bottom, x_o + 1.75, 1.1, "→ g → Σ", 10)
    bottom.set_title(f"attention: {heads} heads, {per} per rank", fontsize=10, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, fc=RANK_COLOURS[r], alpha=0.75) for r in range(t)]
    handles.append(plt.Rectangle((0, 0), 1, 1, fc=WHOLE))
    top.legend(handles, [f"rank {r}" for r in range(t)] + ["whole (replicated)"], fontsize=8,
               ncols=t + 1, loc="lower right", bbox_to_anchor=(1.0, 1.0))
    for ax in (top, bottom):
        ax.set_xlim(-0.2, max(11.3, 10.95 + 0.25 * t))  # the stack of Z_r inside
        ax.set_ylim(-0.6, 2.45)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(f"Megatron tensor parallelism on {t} ranks: which rank holds which block")
    return fig


def loss_differences(reference: list[float], runs: dict[str, list[float]], rtol: float = 1e-5,
                     title: str = "loss against one process") -> Figure:
    """Left, the reference's loss by step; right, |loss - reference| for each of `runs` ({label:
    losses}), log scale, beside rtol * reference (the tolerance, dashed) and the spacing of float32
    numbers at the reference (one rounding step, dotted). An exact 0 cannot sit on a log axis: it
    is drawn as a hollow marker on the floor, below every nonzero difference."""
    ref = np.asarray(reference, dtype=np.float64)
    steps = np.arange(1, len(ref) + 1)
    diffs = {label: np.abs(np.asarray(losses, dtype=np.float64) - ref)
             for label, losses in runs.items()}
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    floor = min([d[d > 0].min() for d in diffs.values() if (d > 0).any()] + [ulp.min()]) / 10
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
    left.plot(steps, ref, "o-", color="black")
    left.set(xlabel="step", ylabel="loss (nats/token)", title="one process")
    right.plot(steps, rtol * ref, "--", color="black", label=f"tolerance: {rtol:g} × loss")
    right.plot(steps, ulp, ":", color="grey", label="float32 rounding step at the loss")
    width = 0.5 / max(1, len(diffs))
    for k, ((label, d), colour) in enumerate(zip(diffs.items(), RANK_COLOURS * 2)):
        x = steps + (k - (len(diffs) - 1) / 2) * width  # side by side within a step
        right.plot(x[d > 0], d[d > 0], "o", color=colour, label=label)
        right.plot(x[d == 0], np.full((d == 0).sum(), floor), "o", mfc="none", color=colour)
    right.axhline(floor, color="grey", lw=0.5)
    right.text(steps[0], floor * 1.3, "hollow: exactly equal (0)", fontsize=7, va="bottom")
    right.set_yscale("log")
    right.set(xlabel="step", ylabel="|loss − one process's| (nats/token)", title=title,
              ylim=(floor / 2, 3 * rtol * ref.max()))
    right.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in (left, right):
        ax.set_xticks(steps)
        ax.grid(alpha=0.3, which="both")
    return fig


def activation_bars(runs: dict[str, tuple[dict, int]],
                    title: str = "activation memory per rank") -> Figure:
    """{label: (predicted bytes by part, measured bytes)}: the prediction stacked by part (hatched,
    left), the measurement (right), in KiB, with measured / predicted above each pair."""
    parts = list(next(iter(runs.values()))[0])
    colours = dict(zip(parts, RANK_COLOURS[3:]))
    fig, ax = plt.subplots(figsize=(1.5 + 1.1 * len(runs), 3.8), layout="constrained")
    for x, (label, (predicted, measured)) in enumerate(runs.items()):
        bottom = 0.0
        for part in parts:
            ax.bar(x - 0.2, predicted[part] / 1024, 0.38, bottom=bottom, color=colours[part],
                   hatch="//",
                   ec="white", lw=0.3, label=f"predicted: {part}" if x == 0 else None)
            bottom += predicted[part] / 1024
        ax.bar(x + 0.2, measured / 1024, 0.38, color="#555555",
               label="measured" if x == 0 else None)
        ax.text(x, max(bottom, measured / 1024), f"×{measured / sum(predicted.values()):.3f}",
                ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(runs)), list(runs), fontsize=8)
    ax.set(ylabel="KiB per rank", title=title)
    handles, labels = ax.get_legend_handles_labels()
    handles.append(plt.Line2D([], [], ls="none"))  # no mark: explains the numbers above the pairs
    ax.legend(handles, [*labels, "×r above a pair:\nmeasured / predicted"], fontsize="small",
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def comm_compute(
    ratios: dict[str, dict[str, list[float]]],
    degrees: list[int],
    title: str = "tensor parallelism: communication time / compute time, per layer",
) -> Figure:
    """{model: {link: [comm / compute for each t in degrees]}}, one panel per model, log scale;
    above 1 the all-reduces, which the next matmul waits for, take
    longer than the layer's matmuls."""
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.2 * len(ratios) + 1, 3.6), sharey=True,
                             squeeze=False,
                             layout="constrained")
    for ax, (model, links) in zip(axes[0], ratios.items()):
        for (link, ys), marker in zip(links.items(), "osd^v"):
            ax.plot(degrees, ys, marker + "-", label=link)
        ax.axhline(1, color="black", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(degrees, [str(t) for t in degrees])
        ax.set(xlabel="tensor-parallel degree t", title=model)
        ax.grid(alpha=0.3, which="both")
    axes[0, 0].set_ylabel("communication / compute")
    axes[0, -1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    return fig


def block_timing(widths: dict[str, dict[str, tuple[float, float, float]]],
                 title: str = "one TP block, forward + backward, measured") -> Figure:
    """{label: {"comm": (q1, median, q3), "compute": (q1, median, q3)}} in seconds: per label a
    bar for the collectives and one for the rest, at their median, whiskers from q1 to q3, in ms,
    with comm / compute (of the medians) above."""
    fig, ax = plt.subplots(figsize=(4.5 + 1.5 * len(widths), 4.2), layout="constrained")
    top = 0.0
    for x, (label, parts) in enumerate(widths.items()):
        for dx, part, colour, name in ((-0.2, "comm", RANK_COLOURS[0], "f/g all-reduces"),
                                       (0.2, "compute", RANK_COLOURS[1],
                                        "the rest (matmuls, attention, GeLU, LayerNorms)")):
            q1, med, q3 = (1e3 * v for v in parts[part])
            ax.bar(x + dx, med, 0.38, color=colour, yerr=[[med - q1], [q3 - med]], capsize=4,
                   label=name if x == 0 else None)
        high = 1e3 * max(parts["comm"][2], parts["compute"][2])
        top = max(top, high)
        ax.text(x, high * 1.03, f"comm / compute\n{parts['comm'][1] / parts['compute'][1]:.2f}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(widths)), list(widths), fontsize=8)
    ax.set_xlim(-0.6, len(widths) - 0.4)
    ax.set_ylim(0, top * 1.35)
    ax.set(ylabel="ms per forward + backward\n(median; whiskers: quartiles)", title=title)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=1)
    ax.grid(axis="y", alpha=0.3)
    return fig
