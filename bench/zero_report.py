"""The tables and plots of bench/zero.py's results: what its run() makes of the workers' times,
losses and memory (rows, flags, verdicts, ZeRO-2's gradient saving, where ZeRO-3's extra memory
comes from, plot)."""
from __future__ import annotations

import statistics

import common  # bench/ is on sys.path
from zero_variants import SETS, peer_of, variants

from minipar.lessons import demos
from minipar.model import GPTConfig

GOAL = {"fsdp2": 1.25}  # the project's step-time goals, by peer; 1.10 for the others
MIB = 2**20


def summarise(world: int, runs: list[list[dict]], sets) -> list[dict]:
    """One row per variant from every launch (runs[launch][rank] = worker's result)."""
    slowest = [demos.slowest_rank(by_rank) for by_rank in runs]
    memory = [rank["memory"] for rank in runs[0]]  # first launch, by rank
    rows = []
    for name in variants(sets):
        peer, floor = peer_of(name, sets), name.startswith("local")
        steps = [t for launch in slowest for t in launch[name]]
        rel = lambda a, b: abs(a - b) / abs(b)
        pairs = [(rank["losses"][name], rank["losses"][peer]) for by_rank in runs
                 for rank in by_rank]
        tools = list(memory[0][name])  # the first gives the memory columns; a second, a check
        fullest = lambda key, v=name, tool=tools[0]: max(m[v][tool][key] for m in memory)
        q1, _, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else (steps[0],) * 3
        rows.append(dict(
            world=world, variant=name, peer=peer, floor=floor, step=statistics.median(steps),
            q1=q1, q3=q3, **common.ratios(slowest, name, peer),
            opt=statistics.median(t for by_rank in runs for rank in by_rank
                                  for t in rank["opt"][name]),
            peak=fullest("peak"), after_forward=fullest("after_forward"),
            between=fullest("between"), gathered=fullest("gathered"),
            exact=all(m[name][tools[0]]["exact"] for m in memory), tool=tools[0],
            check=fullest("peak", tool=tools[1]) if len(tools) > 1 else None,
            peak_ratio=fullest("peak") / fullest("peak", peer),
            first_diff=max(rel(ours[0], theirs[0]) for ours, theirs in pairs),
            loss_diff=max(rel(a, b) for ours, theirs in pairs for a, b in zip(ours, theirs)),
            first_loss=runs[0][0]["losses"][name][0], reps=len(steps)))
    return rows


def table(rows: list[dict]) -> str:
    mib = lambda b: f"{b / MIB:.1f}"
    lines = ["| N | variant | peer | step (ms): median [IQR] | / peer | per launch | in step() "
             "(ms) | peak (MiB) | / peer | after forward (MiB) | between steps (MiB) | full "
             "params after forward (MiB) | peak by MemTracker (MiB) | loss vs peer: 1st step "
             "(all) | reps |", "|" + "---|" * 15]
    for r in rows:
        mark = "(floor)" if r["floor"] else "(peer)" if r["variant"] == r["peer"] else None
        ratio, spread, peak_ratio, loss = (mark, "—", mark, "—") if mark else (
            f"**{r['ratio']:.2f}**", f"{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f}",
            f"**{r['peak_ratio']:.2f}**", f"{r['first_diff']:.0e} ({r['loss_diff']:.0e})")
        lines.append(
            f"| {r['world']} | {r['variant']} | {'—' if mark else r['peer']} "
            f"| {r['step'] * 1e3:.1f} [{r['q1'] * 1e3:.0f}–{r['q3'] * 1e3:.0f}] | {ratio} "
            f"| {spread} | {r['opt'] * 1e3:.1f} | {mib(r['peak'])}{'' if r['exact'] else '*'} "
            f"| {peak_ratio} | {mib(r['after_forward'])} | {mib(r['between'])} "
            f"| {mib(r['gathered'])} | {'—' if r['check'] is None else mib(r['check'])} "
            f"| {loss} | {r['reps']} |")
    return "\n".join(lines)


def flags(rows: list[dict]) -> str:
    """Warnings about the run itself: a variant faster than its no-communication floor (noise
    larger than the differences), a peak that is not exactly the steady step's."""
    out = []
    for r in rows:
        floor = next((f for f in rows if f["world"] == r["world"] and f["floor"]
                      and f["variant"] == ("local-bf16" if "bf16" in r["variant"] else "local")),
                     None)
        if floor and not r["floor"] and r["step"] < floor["step"]:
            out.append(f"**Flag**: at N = {r['world']}, {r['variant']}'s median step "
                       f"({r['step'] * 1e3:.1f} ms) is below the floor's, {floor['variant']} "
                       f"({floor['step'] * 1e3:.1f} ms), which does no communication: noise "
                       "larger than the differences.")
        if not r["exact"]:
            out.append(f"**Flag**: at N = {r['world']}, {r['variant']}: a moment before the "
                       "measured step was fuller than its peak (*), which is then read off the "
                       "tracker's timeline samples (a threaded variant's peak depends on when its "
                       "communication thread finishes).")
    return "\n".join(out) + "\n\n" if out else ""


def verdicts(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["floor"] or r["variant"] == r["peer"]:
            continue
        goal, at = GOAL.get(r["peer"], 1.10), f"{r['peer']}'s at N = {r['world']}"
        simple = " (the simple version)" if r["variant"].endswith("/naive") else ""
        out.append(f"Goal, {r['variant']}{simple} step within {goal:.2f}x of {at}: "
                   f"{'met' if r['ratio'] <= goal else 'NOT met'} (median ratio "
                   f"{r['ratio']:.2f}, per launch {r['ratio_lo']:.2f}–{r['ratio_hi']:.2f}); "
                   f"peak memory no higher: {'met' if r['peak_ratio'] <= 1.0 else 'NOT met'} "
                   f"(ratio {r['peak_ratio']:.2f}, "
                   f"{(r['peak'] - _peer(rows, r)['peak']) / MIB:+.1f} MiB).")
    return "\n".join(out)


def _peer(rows: list[dict], r: dict) -> dict:
    return next(p for p in rows if p["world"] == r["world"] and p["variant"] == r["peer"])


def gradient_term(rows: list[dict], cfg: GPTConfig) -> str:
    """ZeRO-2's measured peak against ZeRO-1's, beside the paper's gradient term (1 - 1/N) * G."""
    grads = 4 * cfg.num_params  # fp32 gradients: 4 bytes a parameter
    out = []
    for world in sorted({r["world"] for r in rows}):
        got = {r["variant"]: r["peak"] for r in rows if r["world"] == world}
        term = (1 - 1 / world) * grads / MIB
        for mode in ("bucketed", "naive"):
            one, two = got.get(f"zero1/{mode}"), got.get(f"zero2/{mode}")
            if one is not None and two is not None:
                out.append(f"N = {world}, {mode}: ZeRO-2 peak below ZeRO-1 by "
                           f"{(one - two) / MIB:.1f} MiB; the paper's gradient term (1 - 1/N) * G "
                           f"= {term:.1f} MiB (G = {grads / MIB:.1f} MiB: fp32 gradients, 4 bytes "
                           f"a parameter).")
    return "\n".join(out)


def findings(rows: list[dict], cfg: GPTConfig) -> str:
    """Where ZeRO-3's extra memory over FSDP2 comes from, read off the measured columns."""
    full, block = 4 * cfg.num_params, 4 * (12 * cfg.d_model ** 2 + 12 * cfg.d_model)
    out, leaks = [], False
    for r in rows:
        if r["peer"] != "fsdp2" or r["variant"] == "fsdp2" or r["floor"] or r["peak_ratio"] <= 1.0:
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


def bucket_findings(rows: list[dict], cfg: GPTConfig, bucket_mb: float) -> str:
    """Where a bucketed ZeRO-1/2's extra peak over its peer comes from, beside what the design
    holds in backward: up to two full buckets (one in flight, one filling, 2B: fp32 under bf16 too,
    the main gradients), the gradient shards made so far (at most G/N) and the ring's receive space
    ((N-1)/N of a bucket); nothing of these between steps."""
    grads, bucket, out = 4 * cfg.num_params, bucket_mb * MIB, []
    for r in rows:
        if r["floor"] or r["variant"] not in ("zero1/bucketed", "zero2/bucketed", "zero2-bf16/"
                                              "minipar") or r["peak_ratio"] <= 1.0:
            continue
        p, n, f = _peer(rows, r), r["world"], lambda b: f"{b / MIB:.1f}"
        out.append(
            f"- N = {n}, {r['variant']}: peak {(r['peak'] - p['peak']) / MIB:+.1f} MiB over "
            f"{r['peer']}; after forward {(r['after_forward'] - p['after_forward']) / MIB:+.1f} "
            f"MiB; in backward its total rises {f(r['peak'] - r['after_forward'])} MiB above "
            f"that, {r['peer']}'s {f(p['peak'] - p['after_forward'])}: up to two full buckets "
            f"(2B = {f(2 * bucket)}, fp32), the gradient shards made so far (G/N = "
            f"{f(grads / n)} at most) and the ring's receive space ((N-1)/N x bucket = "
            f"{f((n - 1) / n * bucket)}).")
    return "Where minipar's ZeRO-1/2 extra memory comes from:\n" + "\n".join(out) + "\n\n" \
        if out else ""


def plot(rows: list[dict], s: dict, path) -> None:
    """Step time and peak memory by variant (memory: the part held between steps hatched), a row
    of panels per world, the variants coloured by the set they are first in."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = list(s["worlds"])
    names = variants(s["sets"])
    colour = {v: f"C{i}" for i, set_ in reversed(list(enumerate(s["sets"]))) for v in SETS[set_][1]}
    fig, axes = plt.subplots(len(worlds), 2, figsize=(13, 0.32 * len(names) * len(worlds) + 1.4),
                             squeeze=False)
    for (ax_t, ax_m), world in zip(axes, worlds):
        by = [next(r for r in rows if r["world"] == world and r["variant"] == n) for n in names]
        y = range(len(names))[::-1]
        colours = [colour[n] for n in names]
        ax_t.barh(y, [r["step"] * 1e3 for r in by], color=colours,
                  xerr=[[(r["step"] - r["q1"]) * 1e3 for r in by],
                        [(r["q3"] - r["step"]) * 1e3 for r in by]])
        ax_m.barh(y, [r["peak"] / MIB for r in by], color=colours)
        ax_m.barh(y, [r["between"] / MIB for r in by], color="none", edgecolor="k", hatch="//",
                  lw=0.5)
        for ax, label in ((ax_t, "step time (ms): median, IQR"),
                          (ax_m, "peak MiB per rank (hatched: held between steps)")):
            ax.set_yticks(list(y), names, fontsize=8)
            ax.set(xlabel=label, title=f"N = {world}")
            ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"minipar ZeRO and bf16 DP vs PyTorch: {s['model']}, {s['batch']} sequences per "
                 f"rank ({s['bf16_batch']} in bf16), gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
