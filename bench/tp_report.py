"""The tables and plots of bench/tp.py's results: what its run() makes of the workers' times,
losses, gradients and counts (rows, the checks, verdicts, where the time goes, plot)."""
from __future__ import annotations

import statistics

import common  # bench/ is on sys.path
from tp import PEER, VARIANTS

from minipar.lessons import demos

GOAL = 1.0  # the goal: minipar's TP step no slower than DTensor's
LOSS_TOL = 1e-5


def summarise(world: int, runs: list[list[dict]]) -> list[dict]:
    """One row per variant from every launch (runs[launch][rank] = worker's result)."""
    slowest = [demos.slowest_rank(by_rank) for by_rank in runs]
    every = lambda phase, name: [t for by_rank in runs for r in by_rank for t in r[phase][name]]
    rows = []
    for name in VARIANTS:
        firsts = [(r["losses"][name][0], r["losses"][PEER][0]) for by_rank in runs for r in by_rank]
        rows.append(dict(
            world=world, variant=name,
                         step=statistics.median(t for launch in slowest for t in launch[name]),
            **common.ratios(slowest, name, PEER),
            **{phase: statistics.median(every(phase, name))
               for phase in ("forward", "backward", "opt")},
            first_loss=firsts[0][0], first_diff=max(abs(a - b) for a, b in firsts),
            loss_diff=max(abs(a - b) / abs(b) for by_rank in runs for r in by_rank
                          for a, b in zip(r["losses"][name], r["losses"][PEER])),
            grad_diff=max(r["grad_diff"][name] for by_rank in runs for r in by_rank),
            calls=runs[0][0]["calls"][name], reps=sum(len(launch[name]) for launch in slowest)))
    return rows


def sanity(rows: list[dict]) -> str:
    """The equality checks, in words: the table below is worth reading only if these hold."""
    out = []
    for world in sorted({r["world"] for r in rows}):
        rs = [r for r in rows if r["world"] == world and r["variant"] != PEER]
        worst = max(r["first_diff"] for r in rs)
        out.append(f"Check, t = {world}: first-step loss of every minipar variant = dtensor's "
                   f"({next(r for r in rows if r['world'] == world)['first_loss']:.6f}) within "
                   f"{LOSS_TOL:g}: "
                   f"{'yes' if worst <= LOSS_TOL else 'NO'} (largest difference {worst:.1e}, every "
                   "rank and "
                   "launch); first gradients, largest relative difference "
                   f"{max(r['grad_diff'] for r in rs):.1e}.")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    ms = lambda t: f"{t * 1e3:.1f}"  # noqa: E731
    lines = ["| t | variant | step (ms) | / dtensor | per launch | forward (ms) | backward (ms) | "
             "optimizer (ms) "
             "| collectives in forward + backward / gloo calls | loss rel. diff (all steps) | reps "
             "|",
             "|" + "---|" * 11]
    for r in rows:
        peer = r["variant"] == PEER
        ratio, spread, diff = ("(peer)", "—", "—") if peer else (
            f"**{r['ratio']:.2f}**", f"{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f}",
                                                                 f"{r['loss_diff']:.1e}")
        calls = " / ".join(", ".join(f"{v} {k}" for k, v in sorted(r["calls"][kind].items()))
                           for kind in ("logical", "gloo"))
        lines.append(f"| {r['world']} | {r['variant']} | {ms(r['step'])} | {ratio} | {spread} | "
                     f"{ms(r['forward'])} "
                     f"| {ms(r['backward'])} | {ms(r['opt'])} | {calls} | {diff} | {r['reps']} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> str:
    def word(r):
        if r["ratio"] > GOAL:
            return "NOT met"
        return "met" if r["ratio_hi"] <= GOAL else "met on the median, not in every launch"
    return "\n".join(
        f"Goal, {r['variant']} step no slower than dtensor's ({GOAL:.2f}x) at t = {r['world']}: "
        f"{word(r)} "
        f"(median ratio {r['ratio']:.2f}, launch by launch "
        f"{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f})."
        for r in rows if r["variant"] != PEER)


def findings(rows: list[dict]) -> str:
    """Where the differences come from, read off the phases and the counts of the first step."""
    out = ["Where the time goes (medians by phase, all ranks):"]
    for world in sorted({r["world"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["world"] == world}
        ours, ring, sp, peer = by["tp/torch"], by["tp/minipar"], by["tp+sp/torch"], by[PEER]
        delta = lambda a, b, phase: f"{(a[phase] - b[phase]) * 1e3:+.1f}"  # noqa: E731
        out.append(
            f"- t = {world}, dtensor over tp/torch (the same {sum(peer['calls']['gloo'].values())} "
            "gloo all-reduces "
            f"a step): forward {delta(peer, ours, 'forward')} ms, backward "
            f"{delta(peer, ours, 'backward')} ms, "
            f"optimizer {delta(peer, ours, 'opt')} ms; its forward + backward recorded "
            f"{peer['calls']['events']:,} profiler events against {ours['calls']['events']:,}: "
            "DTensor's "
            "dispatch (sharding propagation, wrapping, redistribution) on every operator, and "
            "AdamW's foreach "
            "kernels run on DTensors. tp/minipar over tp/torch (the ring instead of gloo's "
            "collectives, "
            f"{sum(ring['calls']['gloo'].values())} sends and receives instead of "
            f"{sum(ours['calls']['gloo'].values())} calls): forward {delta(ring, ours, 'forward')} "
            "ms, backward "
            f"{delta(ring, ours, 'backward')} ms. tp+sp/torch over tp/torch: forward "
            f"{delta(sp, ours, 'forward')} "
            f"ms, backward {delta(sp, ours, 'backward')} ms.")
    out.append(
        "On this CPU the comparison is mostly about overhead: the model is small, so DTensor's "
        "per-operator work "
        "is a large share of a step, and every collective is latency-bound (a few hundred KiB), "
        "where the ring's "
        "2 (t-1) dependent send/recv rounds, driven from Python, each a wait and a wake-up, cost "
        "more than "
        "gloo's all-reduce in C++ (more so on a shared machine, where each wake-up waits to be "
        "scheduled). "
        "Sequence parallelism cannot pay on gloo: "
        "gloo runs a reduce-scatter as a whole all-reduce, so SP keeps the all-reduces' bytes and "
        "adds the "
        "all-gathers (and a (B, T, h) <-> (T, B, h) copy at each); its gain is activation memory, "
        "not time. On "
        "GPUs, where DTensor's dispatch overlaps the kernels and NCCL's reduce-scatter is half an "
        "all-reduce, "
        "the ratios would differ: this measures the CPU/gloo case only.")
    return "\n".join(out)


def plot(rows: list[dict], s: dict, path) -> None:
    """Step time by variant and world, stacked by phase (forward, backward, optimizer)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.2))
    worlds, width = list(s["worlds"]), 0.8 / len(VARIANTS)
    for i, name in enumerate(VARIANTS):
        x = np.arange(len(worlds)) + (i - (len(VARIANTS) - 1) / 2) * width
        by = [next(r for r in rows if r["world"] == w and r["variant"] == name) for w in worlds]
        bottom = np.zeros(len(worlds))
        for phase, hatch in (("forward", ""), ("backward", "//"), ("opt", "..")):
            heights = np.array([r[phase] * 1e3 for r in by])
            ax.bar(x, heights, width, bottom=bottom, color=f"C{i}", hatch=hatch, edgecolor="white",
                   label=name if phase == "forward" else None)
            bottom += heights
    ax.set_xticks(range(len(worlds)), [f"t = {w}" for w in worlds])
    ax.set(ylabel="ms (median; plain forward, // backward, .. optimizer)",
           title=f"minipar TP vs DTensor TP: {s['model']} (n_head {s['n_head']}), {s['batch']} "
                 "sequences, gloo")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
