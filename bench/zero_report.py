"""The tables and plots of bench/zero.py's results: what its run() makes of the workers' times,
losses and memory (rows, verdicts, where ZeRO-3's extra memory comes from, plot)."""
from __future__ import annotations

import statistics

import common  # bench/ is on sys.path
from zero import PEER, VARIANTS

from minipar.lessons import demos
from minipar.model import GPTConfig

GOAL = {"fsdp2": 1.25, "ddp+zero-r": 1.10}  # the project's step-time goals, by peer


def summarise(world: int, runs: list[list[dict]]) -> list[dict]:
    """One row per variant from every launch (runs[launch][rank] = worker's result)."""
    slowest = [demos.slowest_rank(by_rank) for by_rank in runs]
    memory = [rank["memory"] for rank in runs[0]]  # first launch, by rank
    rows = []
    for name in VARIANTS:
        peer = PEER[name]
        steps = [t for launch in slowest for t in launch[name]]
        loss_diff = max(abs(a - b) / abs(b) for by_rank in runs for rank in by_rank
                        for a, b in zip(rank["losses"][name], rank["losses"][peer]))
        first_equal = all(rank["losses"][name][0] == rank["losses"][peer][0]
                          for by_rank in runs for rank in by_rank)
        fullest = lambda key, v=name: max(m[v][key] for m in memory)
        rows.append(dict(
            world=world, variant=name, peer=peer, step=statistics.median(steps),
                         **common.ratios(slowest, name, peer),
            opt=statistics.median(t for by_rank in runs for rank in by_rank
                                  for t in rank["opt"][name]),
            peak=fullest("peak"), after_forward=fullest("after_forward"),
                         between=fullest("between"),
            gathered=fullest("gathered"),
            peak_ratio=fullest("peak") / max(m[peer]["peak"] for m in memory),
            first_loss=runs[0][0]["losses"][name][0], first_equal=first_equal, loss_diff=loss_diff,
            reps=len(steps)))
    return rows


def table(rows: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:.1f}"
    lines = ["| world | variant | step (ms) | / peer | per launch | in step() (ms) | peak memory "
             "(MiB) | / peer "
             "| after forward (MiB) | between steps (MiB) | full params held after forward (MiB) | "
             "first loss = peer "
             "| loss rel. diff (all steps) | reps |", "|" + "---|" * 14]
    for r in rows:
        is_peer = r["variant"] == r["peer"]
        ratio, spread, peak_ratio, same, diff = ("(peer)", "—", "(peer)", "—",
                                                 "—") if is_peer else (
            f"**{r['ratio']:.2f}**", f"{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f}",
                                                                       f"**{r['peak_ratio']:.2f}**",
            "yes" if r["first_equal"] else "NO", f"{r['loss_diff']:.1e}")
        lines.append(f"| {r['world']} | {r['variant']} | {r['step'] * 1e3:.1f} | {ratio} | "
                     f"{spread} "
                     f"| {r['opt'] * 1e3:.1f} | {mib(r['peak'])} | {peak_ratio} | "
                     f"{mib(r['after_forward'])} "
                     f"| {mib(r['between'])} | {mib(r['gathered'])} "
                     f"| {same} ({r['first_loss']:.6f}) | {diff} | {r['reps']} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["variant"] == r["peer"]:
            continue
        goal = GOAL[r["peer"]]
        out.append(f"Goal, {r['variant']} step within {goal:.2f}x of {r['peer']}'s at N = "
                   f"{r['world']}: "
                   f"{'met' if r['ratio'] <= goal else 'NOT met'} (median ratio {r['ratio']:.2f}).")
        if r["peer"] == "fsdp2":
            out.append(f"Goal, {r['variant']} peak memory per rank no higher than fsdp2's at N = "
                       f"{r['world']}: "
                       f"{'met' if r['peak_ratio'] <= 1.0 else 'NOT met'} (ratio "
                       f"{r['peak_ratio']:.2f}).")
    return "\n".join(out)


def findings(rows: list[dict], cfg: GPTConfig) -> str:
    """Where ZeRO-3's extra memory over FSDP2 comes from, read off the measured columns."""
    full, block = 4 * cfg.num_params, 4 * (12 * cfg.d_model ** 2 + 12 * cfg.d_model)
    out, leaks = [], False
    for r in rows:
        if r["peer"] != "fsdp2" or r["variant"] == "fsdp2" or r["peak_ratio"] <= 1.0:
            continue
        peer = next(p for p in rows if p["world"] == r["world"] and p["variant"] == "fsdp2")
        leaks |= r["gathered"] > peer["gathered"] + block
        out.append(f"- N = {r['world']}, {r['variant']}: peak "
                   f"{(r['peak'] - peer['peak']) / 2**20:+.1f} MiB over "
                   f"fsdp2; held between steps {(r['between'] - peer['between']) / 2**20:+.1f} "
                   "MiB; full parameters "
                   f"held at the end of forward {r['gathered'] / 2**20:.1f} MiB against fsdp2's "
                   f"{peer['gathered'] / 2**20:.1f} (the whole model is {full / 2**20:.1f} MiB, "
                   "one block "
                   f"{block / 2**20:.1f} MiB).")
    if not out:
        return ""
    why = ("A unit's gathered parameters are freed after its forward only if their storage goes: a "
           "Linear saves "
           "`weight.t()`, a view of the gathered buffer, for its backward, so freeing by "
           "re-pointing the parameters "
           "(`p.data = empty`) keeps each gathered buffer alive until backward, which then gathers "
           "a second copy. "
           "FSDP2 frees with `storage.resize_(0)` and all-gathers back into the same storage, so "
           "the saved views "
           "see the data again. " if leaks else "")
    return ("Where ZeRO-3's extra memory comes from:\n" + "\n".join(out) + f"\n\n{why}Held between "
                                                                           "steps: "
            "fsdp2's zero_grad sets the gradient shards to None (4P/N bytes), a zeroing zero_grad "
            "keeps them; "
            "the /minipar collectives also keep the ring's receive space.\n\n")


def plot(rows: list[dict], s: dict, path) -> None:
    """Step time and peak memory by variant and world (memory: the
    part held between steps hatched)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.4))
    worlds, width = list(s["worlds"]), 0.8 / len(VARIANTS)
    for i, name in enumerate(VARIANTS):
        x = np.arange(len(worlds)) + (i - (len(VARIANTS) - 1) / 2) * width
        by = [next(r for r in rows if r["world"] == w and r["variant"] == name) for w in worlds]
        ax_t.bar(x, [r["step"] * 1e3 for r in by], width, label=name, color=f"C{i}")
        ax_m.bar(x, [r["peak"] / 2**20 for r in by], width, label=name, color=f"C{i}")
        ax_m.bar(x, [r["between"] / 2**20 for r in by], width, color="none", edgecolor="k",
                 hatch="//", lw=0.5)
    for ax, label, title in ((ax_t, "step time (ms, median)", "training step"),
                             (ax_m, "MiB per rank (fullest rank)", "peak memory (hatched: held "
                                                                   "between steps)")):
        ax.set_xticks(range(len(worlds)), [f"N = {w}" for w in worlds])
        ax.set(ylabel=label, title=title)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*ax_t.get_legend_handles_labels(), loc="lower center", ncol=len(VARIANTS),
               fontsize=8)
    fig.suptitle(f"minipar ZeRO vs PyTorch (FSDP2, ZeroRedundancyOptimizer + DDP): {s['model']}, "
                 f"{s['batch']} sequences per rank, gloo")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
