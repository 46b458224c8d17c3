"""The tables and plots of bench/pp.py's results: what its run() makes of the workers' times and
timelines (rows, the check against one device, verdicts, time per action, notes, plot)."""
from __future__ import annotations

import statistics

import common  # bench/ is on sys.path
from pp import PAIRS, pair_names, variants

from minipar.lessons import demos
from minipar.pipeline import Timeline, schedule, simulate

GOAL = 1.10  # the goal: minipar's step within 1.10x of PyTorch's, for each schedule
LOSS_TOL = 1e-5


def _bubble_and_busy(by_rank: list[dict], name: str) -> tuple[list[float], list[float]]:
    """Per repetition: the measured bubble (all ranks' events on one clock)
    and the busiest rank's busy time."""
    out = ([], [])
    for rep in range(len(by_rank[0]["events"][name])):
        tl = Timeline.from_events([r["events"][name][rep] for r in by_rank])
        out[0].append(tl.bubble), out[1].append(max(tl.busy))
    return out


def _simulated(name: str, by_rank: list[dict], p: int, m: int) -> tuple[float, float]:
    """minipar's schedule simulated: (bubble with F = B per micro-batch and rank, bubble with its
    measured median F, B, W time per chunk)."""
    sched, _, v = name.split("/")[1].partition(" v=")
    v = int(v or 1)
    plan = schedule(sched, p, m, v)
    split = sched == "zb-h1"
    equal = {"F": 1 / v, "B": 0.5 / v, "W": 0.5 / v} if split else {"F": 1 / v, "B": 1 / v}
    times = {}
    for r in by_rank:
        for rep in r["events"][name]:
            for (op, c, _), t0, t1 in rep:
                times.setdefault((op, c), []).append(t1 - t0)
    measured = {op: [statistics.median(times[op, c]) for c in range(p * v)]
                for op in ("FBW" if split else "FB")}
    return (simulate(plan, p, m, v, cost=equal).bubble,
            simulate(plan, p, m, v, cost=measured).bubble)


def summarise(world: int, runs: list[list[dict]], s: dict) -> list[dict]:
    """One row per PAIRS entry from every launch (runs[launch][rank] = worker's result)."""
    slowest = [demos.slowest_rank(by_rank) for by_rank in runs]
    rows = []
    for row in PAIRS:
        ours, theirs = pair_names(row)
        out = dict(world=world, row=row, ours=ours, theirs=theirs)
        for side, name in (("ours", ours), ("theirs", theirs)):
            if name not in slowest[0]:
                out[f"{side}_error"] = runs[0][0]["errors"].get(name, "did not run")
                continue
            bubbles, busy = zip(*(_bubble_and_busy(by_rank, name) for by_rank in runs))
            out[f"{side}_step"] = statistics.median(t for launch in slowest for t in launch[name])
            out[f"{side}_bubble"] = statistics.median(b for launch in bubbles for b in launch)
            out[f"{side}_busy"] = statistics.median(b for launch in busy for b in launch)
        if "ours_step" in out and "theirs_step" in out:
            out |= common.ratios(slowest, ours,
                                 theirs) | dict(reps=sum(len(launch[ours]) for launch in slowest))
        if "ours_step" in out:
            out["sim_equal"], out["sim_measured"] = _simulated(ours, runs[0], world,
                                                               s["microbatches"])
        rows.append(out)
    return rows


def check_table(launches: dict) -> str:
    """The first step of every variant against the single-device reference (first launch)."""
    lines = ["| p | variant | first loss | reference loss | loss diff | grads: max rel. diff | "
             "same |",
             "|" + "---|" * 7]
    for world, runs in launches.items():
        by_rank = runs[0]
        ref = by_rank[0]["ref_loss"]
        for name in variants():
            if name in by_rank[0]["errors"]:
                lines.append(f"| {world} | {name} | did not run: {by_rank[0]['errors'][name]} | | "
                             "| | |")
                continue
            loss = by_rank[-1]["loss"][name]
            grad = max(r["grad_diff"][name] for r in by_rank)
            ok = abs(loss - ref) <= LOSS_TOL and grad <= 1e-4
            lines.append(f"| {world} | {name} | {loss:.7f} | {ref:.7f} | {abs(loss - ref):.1e} | "
                         f"{grad:.1e} "
                         f"| {'yes' if ok else '**NO**'} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> str:
    """The goal, met or not, for every schedule and world that ran on both sides."""
    return "\n".join(f"Goal, minipar {r['row']} within {GOAL:.2f}x of PyTorch's step at p = "
                     f"{r['world']}: "
                     f"{'met' if r['ratio'] <= GOAL else 'NOT met'} (median ratio "
                     f"{r['ratio']:.2f})."
                     for r in rows if "ratio" in r)


def table(rows: list[dict]) -> str:
    ms = lambda r, k: f"{r[k] * 1e3:.1f}" if k in r else "—"  # noqa: E731
    pct = lambda r, k: f"{r[k]:.1%}" if k in r else "—"  # noqa: E731
    lines = ["| p | schedule | minipar (ms) | PyTorch (ms) | minipar / PyTorch | per launch | "
             "minipar busy (ms) "
             "| PyTorch busy (ms) | minipar bubble | sim F=B | sim measured | PyTorch bubble | "
             "reps |",
             "|" + "---|" * 13]
    for r in rows:
        ratio = f"**{r['ratio']:.2f}**" if "ratio" in r else "—"
        spread = f"{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f}" if "ratio" in r else "—"
        lines.append(f"| {r['world']} | {r['row']} | {ms(r, 'ours_step')} | {ms(r, 'theirs_step')} "
                     f"| {ratio} "
                     f"| {spread} | {ms(r, 'ours_busy')} | {ms(r, 'theirs_busy')} | "
                     f"{pct(r, 'ours_bubble')} "
                     f"| {pct(r, 'sim_equal')} | {pct(r, 'sim_measured')} | "
                     f"{pct(r, 'theirs_bubble')} "
                     f"| {r.get('reps', '—')} |")
        for side in ("ours", "theirs"):
            if f"{side}_error" in r:
                lines.append(f"|  | ↳ {r[side]} did not run: {r[f'{side}_error']} |" + " |" * 11)
    return "\n".join(lines)


def op_times(runs: list[list[dict]], name: str) -> dict:
    """Median milliseconds of each op over every timed action of `name`, {(op, "first" | "rest"):
    ms}: chunk 0 apart, since both runtimes treat the first chunk's
    backward specially (it sends nothing)."""
    times = {}
    for by_rank in runs:
        for rank in by_rank:
            for rep in rank["events"].get(name, []):
                for (op, c, _), t0, t1 in rep:
                    times.setdefault((op, "first" if c == 0 else "rest"), []).append(t1 - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def op_table(launches: dict) -> str:
    """Per world and variant: median F, B, W of chunk 0 and of the other chunks, and B + W."""
    lines = ["| p | variant | F (ms) | B chunk 0 | W chunk 0 | B + W chunk 0 | B other | W other | "
             "B + W other |",
             "|" + "---|" * 9]
    for world, runs in launches.items():
        for name in variants():
            if name not in runs[0][0]["step"]:
                continue
            t = op_times(runs, name)
            get = lambda op, where: t.get((op, where), 0.0)  # noqa: E731
            cell = lambda op, where: f"{t[op, where]:.1f}" if (op, where) in t else "—"
            lines.append(f"| {world} | {name} | {get('F', 'rest'):.1f} | {cell('B', 'first')} | "
                         f"{cell('W', 'first')} "
                         f"| {get('B', 'first') + get('W', 'first'):.1f} | {cell('B', 'rest')} | "
                         f"{cell('W', 'rest')} "
                         f"| {get('B', 'rest') + get('W', 'rest'):.1f} |")
    return "\n".join(lines)


def notes(rows: list[dict], launches: dict) -> str:
    """What the tables say, read off them (numbers computed here, not typed in)."""
    out, doubled = [], False
    for world, runs in launches.items():
        ours, theirs = pair_names("zb-h1 (v = 1)")
        if ours not in runs[0][0]["step"] or theirs not in runs[0][0]["step"]:
            continue
        a, b = op_times(runs, ours), op_times(runs, theirs)
        w0, w = a.get(("W", "first"), 0.0), a.get(("W", "rest"), 0.0)
        doubled |= bool(w) and w0 / w > 1.5
        out.append(f"- p = {world}, zb-h1: minipar's chunk 0 costs B "
                   f"{a.get(('B', 'first'), 0):.1f} + W {w0:.1f} ms "
                   f"a micro-batch, PyTorch's B {b.get(('B', 'first'), 0):.1f} + W "
                   f"{b.get(('W', 'first'), 0):.1f} "
                   f"ms; minipar's W on chunk 0 is {w0 / w:.1f}x its W on the other chunks "
                   f"({w:.1f} ms), where the "
                   f"work is the same (the blocks' weight GEMMs; the embeddings' are tiny).")
    if not out:
        return ""
    if doubled:
        out.append("  A W that costs about twice the others re-runs the input-gradient path: "
                   "`_assign` sorts the "
                   "chunk's modules deepest first by `n.count('.') + 1`, which gives the Chunk "
                   "itself (name '') depth "
                   "1, the same as `tok_emb` / `pos_emb` / `ln_f` / `head`; the stable sort keeps "
                   "the Chunk first, so "
                   "it is assigned those parameters with the chunk's *output* as their y, and W's "
                   "backward from there "
                   "to `tok_emb.weight` goes back through all the chunk's blocks (their "
                   "input-gradient matmuls, "
                   "attention and GELU backward again). Depth 0 for the root (`n.count('.') + 1 if "
                   "n else 0`) gives "
                   "each embedding its own output.")
    return ("## Notes\n\n" + "\n".join(out) + "\n"
            "- PyTorch's zero-bubble stage 0 does nothing in B (no input needs a gradient) and "
            "runs its whole, "
            "unsplit backward in W (`backward_weight_one_chunk`: stage_index 0 takes the \"full\" "
            "path), so chunk 0 "
            "pays no split at all; minipar splits every chunk. On the other chunks the two split "
            "differently: "
            "minipar's B is one `autograd.grad` to the input and to every weight-owning module's "
            "output, its W one "
            "backward per module; PyTorch's B walks the autograd graph for the nodes where the "
            "weights join, hooks "
            "them, and its W differentiates from those nodes. Their cost beside the unsplit "
            "backward: the B + W "
            "columns against the 1f1b rows' B.\n"
            "- Busy time and bubbles are not measured at the same boundaries: minipar's F and B "
            "include posting "
            "their sends (a gloo isend writes to the socket in the caller's thread when the "
            "receive is already "
            "posted) and, on the last chunk, the loss; PyTorch's timer wraps its stage's compute "
            "calls only, and "
            "leaves its sends, the loss and the gradient scaling after the last backward in the "
            "idle time. The step "
            "time is the comparison; the bubbles say where each side waits. Four ranks on two "
            "cores share them, so "
            "p = 4 times include waiting for a core, not only for a message.\n\n")


def plot(rows: list[dict], s: dict, path) -> None:
    """Step time (minipar beside PyTorch) and bubble (measured beside
    simulated), by world and schedule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    worlds = list(s["worlds"])
    fig, axes = plt.subplots(2, len(worlds), figsize=(6.5 * len(worlds), 7.5), squeeze=False)
    for col, world in enumerate(worlds):
        rs = [r for r in rows if r["world"] == world]
        x = np.arange(len(rs))
        for ax, keys, labels, unit in (
                (axes[0, col], ("ours_step", "theirs_step"), ("minipar", "PyTorch"), 1e3),
                (axes[1, col], ("ours_bubble", "sim_equal", "sim_measured", "theirs_bubble"),
                 ("minipar measured", "sim F=B", "sim, minipar's op times", "PyTorch measured"),
                 100)):
            width = 0.8 / len(keys)
            for i, (key, label) in enumerate(zip(keys, labels)):
                ax.bar(x + (i - (len(keys) - 1) / 2) * width, [r.get(key, 0) * unit for r in rs],
                       width, label=label)
            ax.set_xticks(x, [r["row"] for r in rs], fontsize=8)
            ax.margins(y=0.3)  # room for the legend above the bars
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=7)
        axes[0, col].set(ylabel="step time (ms, median)", title=f"p = {world}: forward + backward "
                                                                "step")
        axes[1, col].set(ylabel="bubble (% of p x step)", title=f"p = {world}: bubble")
    fig.suptitle(f"minipar PipelineExecutor vs torch.distributed.pipelining: {s['model']} "
                 f"({s['n_layer']} layers), "
                 f"m = {s['microbatches']} x {s['rows']} rows, gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
