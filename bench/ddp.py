"""minipar's DataParallelNaive and DataParallelBucket against torch's DistributedDataParallel:
training step time, fp32, gloo.

Every variant of `minipar.lessons.demos.DP_VARIANTS` trains the same model (same seed) on the same
batch in the same worker processes, with the same bucket size (DDP's bucket_cap_mb = minipar's
bucket_mb): "local" (no gradient sync: the compute floor), "ddp", and minipar naive / bucketed with
its own ring ("/minipar", on a communication thread) or the backend's async all-reduce ("/torch"). A
repetition runs one step of each, starting with a different one each time, after warm-up steps (DDP
rebuilds its buckets after its first step). A step is forward, backward, gradient sync and AdamW,
from a barrier; its time is the slowest rank's. Times are medians over every repetition of every
launch; the ratio is the median of variant/DDP over repetitions run back to back, "per launch" its
range launch by launch. "sync" is the median time a rank spends in finish() (DataParallelNaive's or
DataParallelBucket's): the communication that backward did not hide. "over local" is the step time
minus the local step's.
"grads = DDP" compares each variant's first averaged gradients with DDP's (relative norm).

Weak scaling: tokens/s of the whole job against dp at a fixed batch per rank, each rank with the
same number of intra-op threads, so ideal is a straight line until the ranks outnumber the cores.
The "local" line (no communication at all) shows how much parallel compute the machine really gave;
the gap between it and the others is the cost of communication.
"""
from __future__ import annotations

import os
import statistics
import sys

import common  # bench/ is on sys.path
from common import RESULTS, add_timing_arguments, main

import minipar
from minipar.lessons import demos

DEFAULTS = dict(worlds=(2, 4), scaling=(1, 2, 4), model="small-cpu", batch=4, bucket_mb=2.0, reps=8,
                warmup=2, launches=2, threads=1)
GOAL = 1.10  # the project's goal: minipar's bucketed step within 1.10x of DDP's


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULTS["worlds"]),
                        help="world sizes of the DDP comparison")
    parser.add_argument("--scaling", type=int, nargs="+", default=list(DEFAULTS["scaling"]),
                        help="dp values of the weak-scaling curve")
    parser.add_argument("--model", default=DEFAULTS["model"], help="GPTConfig preset")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per rank")
    parser.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=DEFAULTS["bucket_mb"],
                        help="bucket size in MiB, both implementations")
    add_timing_arguments(parser, DEFAULTS)


def run(args=None, out_dir=RESULTS, **overrides) -> str:
    """Run the comparison; write ddp.md and ddp.png to out_dir; return the markdown tables.

    Called as bench/run.py does, run(args, out_dir) with parsed arguments, or from Python with
    keywords, run(worlds=(2,), reps=4); anything not given takes DEFAULTS.
    """
    s = common.settings(DEFAULTS, args, overrides)
    out_dir, since = common.start(out_dir)
    worlds = sorted({*s["worlds"], *s["scaling"]})
    launches = common.launch_rounds(worlds, s["launches"], lambda world, _: minipar.launch(
        demos.compare_ddp, world, s["model"], s["batch"], s["bucket_mb"], s["reps"], s["warmup"],
        s["threads"] or None, timeout=1800))
    rows = {world: summarise(world, runs) for world, runs in launches.items()}
    md = table([r for world in s["worlds"] for r in rows[world]])
    scale = scaling_table({w: rows[w] for w in s["scaling"]})
    verdict = "\n".join(
        f"Goal, minipar {r['variant']} within {GOAL:.2f}x of DDP's step at N = {w}: "
        f"{'met' if r['ratio'] <= GOAL else 'NOT met'} (median ratio {r['ratio']:.2f})."
        for w in s["worlds"] for r in rows[w] if r["variant"].startswith("bucketed/"))
    cfg = minipar.GPTConfig.preset(s["model"])
    command = (f"python bench/run.py ddp --worlds {' '.join(map(str, s['worlds']))} --scaling "
               f"{' '.join(map(str, s['scaling']))} --model {s['model']} --batch {s['batch']} "
               "--bucket-mb "
               f"{s['bucket_mb']:g} --reps {s['reps']} --warmup {s['warmup']} --launches "
               f"{s['launches']} "
               f"--threads {s['threads']}")
    setup = (f"Model `{s['model']}`: {cfg.num_params:,} parameters, "
             f"{4 * cfg.num_params / 2**20:.1f} MiB "
             f"of fp32 gradients; {s['batch']} x {cfg.seq_len} tokens per rank; buckets of "
             f"{s['bucket_mb']:g} MiB.")
    (out_dir / "ddp.md").write_text(
        f"# data parallel: minipar DataParallelNaive/Bucket vs torch DDP (gloo), fp32\n\n"
        f"{__doc__.strip()}\n\n{setup}\n\n"
        f"{md}\n\n{verdict}\n\n## Weak "
        f"scaling\n\n{scale}\n\n{common.footer(s['threads'], since, command)}")
    plot(rows, s, out_dir / "ddp.png")
    return f"{setup}\n\n{md}\n\n{verdict}\n\n{scale}"


def summarise(world: int, runs: list[list[dict]]) -> list[dict]:
    """One row per variant from every launch (runs[launch][rank] = compare_ddp's result)."""
    slowest = [demos.slowest_rank(by_rank) for by_rank in runs]
    local = statistics.median(t for launch in slowest for t in launch["local"])
    rows = []
    for name in slowest[0]:
        steps = [t for launch in slowest for t in launch[name]]
        rows.append(dict(
            world=world, variant=name, step=statistics.median(steps),
                         **common.ratios(slowest, name, "ddp"),
            over_local=statistics.median(steps) - local,
            sync=statistics.median(t for by_rank in runs for rank in by_rank
                                   for t in rank["sync"][name]),
            tokens_per_s=world * runs[0][0]["tokens"] / statistics.median(steps),
            grad_diff=max((rank["grad_diff"].get(name, 0.0) for by_rank in runs
                           for rank in by_rank)),
            reps=len(steps)))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| world | variant | step (ms) | / DDP | per launch | over local (ms) | sync wait "
             "(ms) "
             "| tokens/s | grads = DDP (rel. diff) | reps |", "|" + "---|" * 10]
    for r in rows:
        same = "—" if r["variant"] in ("local", "ddp") else f"{r['grad_diff']:.1e}"
        sync = {"local": "—", "ddp": "in backward"}.get(r["variant"], f"{r['sync'] * 1e3:.1f}")
        lines.append(f"| {r['world']} | {r['variant']} | {r['step'] * 1e3:.1f} | "
                     f"**{r['ratio']:.2f}** "
                     f"| {r['ratio_lo']:.2f}–{r['ratio_hi']:.2f} | {r['over_local'] * 1e3:+.1f} "
                     f"| {sync} | {r['tokens_per_s']:,.0f} | {same} | {r['reps']} |")
    return "\n".join(lines)


# the lines of the weak-scaling curve
SCALED = ("local", "ddp", "bucketed/minipar", "bucketed/torch")


def scaling_table(rows: dict[int, list[dict]]) -> str:
    """tokens/s by dp, and as a fraction of dp x the dp=1 value of the same variant."""
    base = min(rows)
    lines = ["| dp | " + " | ".join(f"{v} tokens/s (efficiency)" for v in SCALED) + " |",
             "|" + "---|" * (len(SCALED) + 1)]
    for world, rs in rows.items():
        by = {r["variant"]: r for r in rs}
        first = {r["variant"]: r for r in rows[base]}
        cells = [f"{by[v]['tokens_per_s']:,.0f} "
                 f"({by[v]['tokens_per_s'] * base / world / first[v]['tokens_per_s']:.0%})"
                 for v in SCALED]
        lines.append(f"| {world} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: dict[int, list[dict]], s: dict, path) -> None:
    """Step time by variant and world; sync wait, naive vs bucketed; weak scaling."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_s, ax_w, ax_k) = plt.subplots(1, 3, figsize=(15, 4.2))
    worlds, variants = list(s["worlds"]), [r["variant"] for r in rows[s["worlds"][0]]]
    synced = [v for v in variants if v not in ("local", "ddp")]  # the ones with a finish() to time
    for ax, names, key in ((ax_s, variants, "step"), (ax_w, synced, "sync")):
        width = 0.8 / len(names)
        for i, v in enumerate(names):
            x = np.arange(len(worlds)) + (i - (len(names) - 1) / 2) * width
            by = [{r["variant"]: r for r in rows[w]}[v] for w in worlds]
            ax.bar(x, [r[key] * 1e3 for r in by], width, label=v, color=f"C{variants.index(v)}")
    for ax, label, title in ((ax_s, "step time (ms, median)", "training step"),
                             (ax_w, "time in finish() (ms, median)", "exposed communication")):
        ax.set_xticks(range(len(worlds)), [f"N = {w}" for w in worlds])
        ax.set(ylabel=label, title=title)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    dps = list(s["scaling"])
    for i, v in enumerate(variants):
        if v in SCALED:
            ax_k.plot(dps, [{r["variant"]: r for r in rows[d]}[v]["tokens_per_s"] for d in dps],
                      "o-",
                      label=v, color=f"C{i}")
    first = {r["variant"]: r for r in rows[dps[0]]}["local"]["tokens_per_s"] / dps[0]
    ax_k.plot(dps, [first * d for d in dps], ":", color="gray", label="ideal (local at dp=1 × dp)")
    cores = os.cpu_count() or 1
    if cores < max(dps):
        ax_k.axvline(cores, color="red", lw=0.8, ls="--", label=f"ranks = CPU cores ({cores})")
    ax_k.set_ylim(bottom=0)
    ax_k.set(xlabel="dp (ranks)", ylabel="tokens/s (whole job)", xticks=dps,
             title=f"weak scaling, {s['batch']} sequences per rank")
    ax_k.legend(fontsize=7)
    ax_k.grid(alpha=0.3)
    fig.suptitle(f"minipar DataParallelNaive/Bucket vs torch DDP: {s['model']}, "
                 f"buckets of {s['bucket_mb']:g} MiB, gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":  # python bench/ddp.py [options], the same as python
                            #   bench/run.py ddp [options]
    main(sys.modules[__name__])
