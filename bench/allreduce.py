"""minipar's ring all-reduce (minipar.comm.all_reduce) against torch.distributed.all_reduce, fp32.

Both run in the same workers on the same tensors, interleaved: for each size, a warm-up of each,
then repetitions that alternate which one goes first, so that a noisy, shared machine slows both
alike. A repetition is timed per rank from a barrier to the end of the call, and its time is the
slowest rank's. The whole job is launched several times (fresh processes each time: on a machine
with more threads than cores, where the scheduler happens to put them can slow a whole launch down).
Times are medians over every repetition of every launch; the ratio is the median of minipar/torch
over pairs of repetitions run back to back, and "ratio per launch"
the range of that median launch by launch.

    bus bandwidth = size / time * 2(N-1)/N   (what each link carries in a ring; nccl-tests' "busbw")
"""
from __future__ import annotations

import functools
import os
import statistics
import time

import torch
import torch.distributed as dist

import minipar
from minipar import comm

SIZES = [4 << 10 << 2 * i for i in range(8)]  # 4 KB, 16 KB, ..., 64 MB (bytes)
# the ring keeps its receive space between calls (a comm.Scratch), as the techniques that use it do
IMPLS = {"minipar": functools.partial(comm.all_reduce, scratch=comm.Scratch()),
         "torch": dist.all_reduce}


def parse_size(text: str) -> int:
    """"4K", "1M", "64MB" or a number of bytes."""
    text = text.upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def fmt_size(size: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes")
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=SIZES, help="bytes, e.g. 4K "
                                                                                   "1M 64M")
    parser.add_argument("--reps", type=int, default=20, help="repetitions per launch up to 1 MB "
                                                             "(fewer above)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls of each, per size and "
                                                              "launch")
    parser.add_argument("--launches", type=int, default=3, help="fresh launches per world size")


def run(args, out_dir) -> str:
    """Run every world size, write allreduce.md and allreduce.png to out_dir, return the table."""
    launches, load_before = {world: [] for world in args.worlds}, os.getloadavg()[0]
    for _ in range(args.launches):
        for world in args.worlds:
            launches[world].append(minipar.launch(worker, world, args.sizes, args.reps, args.warmup,
                                                  timeout=1800))
    rows = [row for world, runs in launches.items() for row in summarise(world, runs)]
    md = table(rows)
    big = [r["ratio"] for r in rows if r["size"] >= 1 << 20]
    verdict = (f"Goal, minipar within 1.3x of torch's time at 1 MB and above: "
               f"{'met' if max(big) <= 1.3 else 'NOT met'} (worst median ratio there: "
               f"{max(big):.2f})."
               if big else "")
    command = (f"python bench/run.py allreduce --worlds {' '.join(map(str, args.worlds))} --sizes "
               f"{' '.join(fmt_size(s).replace(' ', '') for s in args.sizes)} --reps {args.reps} "
               f"--warmup {args.warmup} --launches {args.launches}")
    (out_dir / "allreduce.md").write_text(
        "# all-reduce: minipar ring vs torch.distributed (gloo), "
        f"fp32\n\n{__doc__.strip()}\n\n{md}\n\n"
        f"{verdict}\n\nMachine: {os.cpu_count()} CPUs, torch {torch.__version__}; each rank has "
        f"max(1, CPUs // N) intra-op threads; 1-minute load average {load_before:.1f} before the "
        "run, "
        f"{os.getloadavg()[0]:.1f} after (the benchmark's own processes count in the second).\n"
        f"Command: `{command}`\n")
    plot(rows, out_dir / "allreduce.png")
    return f"{md}\n\n{verdict}"


def repetitions(size: int, reps: int) -> int:
    """Fewer repetitions above 1 MB (at least 5 per launch)."""
    return max(5, min(reps, reps * (1 << 20) // size))


def worker(sizes: list[int], reps: int, warmup: int) -> list[dict]:
    """On every rank: for each size, {"size", "times": {impl: [seconds per repetition]}, "ok"}."""
    rank = dist.get_rank()
    rows = []
    for size in sizes:
        src = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
        x = torch.empty_like(src)
        sums = {}
        for name, fn in IMPLS.items():  # the two must agree before their times mean anything
            x.copy_(src)
            fn(x)
            sums[name] = x.clone()
        ok = torch.allclose(sums["minipar"], sums["torch"], rtol=1e-5, atol=1e-5)
        del sums
        times = {name: [] for name in IMPLS}
        order = list(IMPLS)
        for i in range(warmup + repetitions(size, reps)):
            for name in order if i % 2 == 0 else order[::-1]:
                x.copy_(src)  # same input every time (repeated sums would grow without bound)
                dist.barrier()
                start = time.perf_counter()
                IMPLS[name](x)
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
        rows.append({"size": size, "times": times, "ok": ok})
    return rows


def summarise(world: int, runs: list[list[list[dict]]]) -> list[dict]:
    """One row per size from every launch (runs[launch][rank][size
    index]): medians and bandwidth."""
    rows = []
    for i, size in enumerate(r["size"] for r in runs[0][0]):
        row, per_launch = {"world": world, "size": size}, {}
        for name in IMPLS:  # a repetition's time is its slowest rank's
            per_launch[name] = [[max(ts)
                                 for ts in zip(*(rank[i]["times"][name] for rank in by_rank))]
                                for by_rank in runs]
            t = statistics.median(t for launch in per_launch[name] for t in launch)
            row[f"{name}_s"], row[f"{name}_busbw"] = t, size / t * 2 * (world - 1) / world
        # the ratio pairs each repetition of minipar with torch's next
        # to it (same launch, same moment)
        ratios = [[m / t for m, t in zip(ms, ts)] for ms,
                  ts in zip(per_launch["minipar"], per_launch["torch"])]
        row["ratio"] = statistics.median(r for launch in ratios for r in launch)
        row["ratio_lo"] = min(statistics.median(launch) for launch in ratios)
        row["ratio_hi"] = max(statistics.median(launch) for launch in ratios)
        row["ok"] = all(rank[i]["ok"] for by_rank in runs for rank in by_rank)
        row["reps"] = sum(len(launch) for launch in per_launch["torch"])
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = ["| world | size | minipar (ms) | torch gloo (ms) | ratio | ratio per launch | minipar "
             "busbw (GB/s) "
             "| torch busbw (GB/s) | reps | results agree |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['world']} | {fmt_size(r['size'])} | {r['minipar_s'] * 1e3:.3f} "
                     f"| {r['torch_s'] * 1e3:.3f} | **{r['ratio']:.2f}** | "
                     f"{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f} "
                     f"| {r['minipar_busbw'] / 1e9:.2f} | {r['torch_busbw'] / 1e9:.2f} | "
                     f"{r['reps']} "
                     f"| {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    """Time and ratio against size, one line per world size and implementation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    for world in sorted({r["world"] for r in rows}):
        rs = [r for r in rows if r["world"] == world]
        sizes = [r["size"] for r in rs]
        line, = ax_t.loglog(sizes, [r["minipar_s"] * 1e3 for r in rs], "o-",
                            label=f"minipar, N={world}")
        ax_t.loglog(sizes, [r["torch_s"] * 1e3 for r in rs], "s--", color=line.get_color(),
                    label=f"torch gloo, N={world}")
        ax_r.semilogx(sizes, [r["ratio"] for r in rs], "o-", color=line.get_color(),
                      label=f"N={world}")
        ax_r.fill_between(sizes, [r["ratio_lo"] for r in rs], [r["ratio_hi"] for r in rs],
                          color=line.get_color(), alpha=0.15)
    ax_t.set(xlabel="tensor size (bytes)", ylabel="time (ms)", title="all-reduce, fp32 (median)")
    ax_r.axhline(1.0, color="gray", lw=0.8)
    ax_r.axhline(1.3, color="red", lw=0.8, ls=":", label="goal (1.3x)")
    ax_r.set(xlabel="tensor size (bytes)", ylabel="minipar time / torch time",
             title="ratio (band: range over launches)")
    ax_t.legend(fontsize=8), ax_r.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
