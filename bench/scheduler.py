"""The scheduler: Gavel's heterogeneity result on a cluster of its shape, and the simulator's speed.

    python bench/run.py scheduler                       # both
    python bench/run.py scheduler --rates 2 4 6 8 --jobs 300 --big-jobs 0   # the sweep only

1. Gavel (Narayanan et al. OSDI 2020) simulated 36 V100 + 36 P100 + 36 K80 and found its
   heterogeneity-aware policies up to 3.5x better in average JCT than heterogeneity-agnostic ones.
   Here: 36 H100 + 36 A100 + 36 TPU v5e from the catalogue, throughputs from minipar's planner (the
   four GPT-2 job types of scheduler.TYPES), Gavel's trace distribution, a sweep of arrival rates;
   every policy's average JCT, and blind / aware for max-min.
2. 10,000 jobs on 2,000 chips (672 H100, 664 A100, 664 TPU v5e; 60 jobs an hour), run first (the
   planner's caches cold): the seconds the throughput matrix takes (the planner, once per job
   type, kind and count) and each policy's simulation (its rounds), in this process.
"""
from __future__ import annotations

import time

from minipar import scheduler

GAVEL = {"dgx-h100": 36, "dgx-a100-80g": 36, "tpu-v5e": 36}
BIG = {"dgx-h100": 672, "dgx-a100-80g": 664, "tpu-v5e": 664}


def add_arguments(p) -> None:
    p.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8, 10],
                   help="arrival rates of the sweep, jobs an hour")
    p.add_argument("--jobs", type=int, default=300, help="jobs a trace of the sweep")
    p.add_argument("--seeds", type=int, default=2, help="traces a rate (their mean JCT)")
    p.add_argument("--big-jobs", type=int, default=10000, help="jobs of the timing run (0: none)")


def sweep(args) -> list[str]:
    names = list(scheduler.POLICIES)
    lines = [f"| jobs/h | {' | '.join(names)} | blind / aware |",
             "|---" * (len(names) + 2) + "|"]
    for per_hour in args.rates:
        jct = dict.fromkeys(names, 0.0)
        for seed in range(args.seeds):
            jobs = scheduler.generate(args.jobs, per_hour, seed=seed)
            matrix = scheduler.throughput_matrix(jobs, GAVEL)
            for p in names:
                jct[p] += scheduler.simulate(jobs, GAVEL, p, rates=matrix).avg_jct / args.seeds
        lines.append(f"| {per_hour:g} | " + " | ".join(f"{jct[p] / 3600:.1f}" for p in names) +
                     f" | {jct['max-min-blind'] / jct['max-min']:.2f}x |")
    return lines


def timing(n_jobs: int) -> list[str]:
    t = time.perf_counter()
    jobs = scheduler.generate(n_jobs, 60, seed=0)
    matrix = scheduler.throughput_matrix(jobs, BIG)
    lines = [f"{n_jobs:,} jobs on {sum(BIG.values()):,} chips: trace and throughput matrix "
             f"{time.perf_counter() - t:.1f} s", "",
             "| policy | rounds | simulation s | avg JCT h | utilization |",
             "|---|---|---|---|---|"]
    for p in scheduler.POLICIES:
        t = time.perf_counter()
        res = scheduler.simulate(jobs, BIG, p, rates=matrix)
        lines.append(f"| {p} | {res.rounds:,} | {time.perf_counter() - t:.1f} | "
                     f"{res.avg_jct / 3600:.1f} | {res.utilization:.2f} |")
    return lines


def run(args, out_dir) -> str:
    text = timing(args.big_jobs) + [""] if args.big_jobs else []   # first: the planner cold
    text += ["Average JCT, hours, on " + " + ".join(f"{n} {k}" for k, n in GAVEL.items()) +
             f" ({args.jobs} jobs a trace, mean of {args.seeds} seeds):", "", *sweep(args)]
    out = "\n".join(text)
    (out_dir / "scheduler.md").write_text(out + "\n")
    return out
