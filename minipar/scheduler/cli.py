"""`python -m minipar schedule`: a trace on a cluster under each policy asked, as a metrics table.

    python -m minipar schedule --policy fifo,las,max-min,minipar
    python -m minipar schedule --trace pai-sample --cluster dgx-h100:36,dgx-a100-80g:36,tpu-v5e:36
    python -m minipar schedule --jobs 200 --jobs-per-hour 6 --gavel-json out/throughputs.json
"""
from __future__ import annotations

import argparse
import math
import os

from minipar import preflight

GAVEL_CLUSTER = "dgx-h100:36,dgx-a100-80g:36,tpu-v5e:36"   # Gavel's shape: 36 of three kinds
BUNDLED = {"pai-sample": "pai_sample.csv", "philly-sample": "philly_sample.json"}


def parse_cluster(text: str) -> dict:
    """"kind:chips,kind:chips" -> {kind: chips}, kinds from the catalogue."""
    from minipar.planner.devices import CATALOGUE
    out = {}
    for part in text.split(","):
        kind, _, chips = part.strip().partition(":")
        if not chips.isdigit() or int(chips) < 1:
            raise ValueError(f"--cluster takes kind:chips pairs such as {GAVEL_CLUSTER}, got "
                             f"{part!r}")
        if kind not in CATALOGUE:
            raise ValueError(f"--cluster: unknown kind {kind!r}; choose from {sorted(CATALOGUE)}")
        out[kind] = out.get(kind, 0) + int(chips)
    return out


def add_parser(sub, formatter) -> argparse.ArgumentParser:
    from minipar.scheduler.policies import POLICIES
    p = sub.add_parser("schedule", help="simulate many training jobs on a shared cluster under "
                                        "scheduling policies",
                       formatter_class=formatter, description=__doc__)
    p.add_argument("--trace", help=f"a PAI task-table CSV or a Philly job-log JSON, or one of "
                                   f"{', '.join(BUNDLED)} (default: a generated trace)")
    p.add_argument("--jobs", type=int, default=100, help="jobs of the generated trace")
    p.add_argument("--jobs-per-hour", type=float, default=4.0, help="its arrival rate")
    p.add_argument("--seed", type=int, default=0, help="its draws (and a read trace's models)")
    p.add_argument("--limit", type=int, help="a read trace's first that many jobs (the public "
                                             "traces hold 100,000 and more)")
    p.add_argument("--cluster", default=GAVEL_CLUSTER, help="kind:chips pairs, kinds from "
                                                            "`minipar plan`'s presets")
    p.add_argument("--policy", default=",".join(POLICIES),
                   help=f"comma-separated, from {', '.join(POLICIES)}")
    p.add_argument("--round-s", type=float, default=360.0, help="seconds a scheduling round")
    p.add_argument("--fairness", type=float, default=0.8,
                   help="minipar's policy: every job keeps this fraction of the max-min optimum")
    p.add_argument("--gavel-json", help="also write the throughput matrix here, in Gavel's form")
    return p


def run(args) -> None:
    from minipar import scheduler
    from minipar.data import bundled
    cluster = parse_cluster(args.cluster)
    policies = [p.strip() for p in args.policy.split(",")]
    unknown = [p for p in policies if p not in scheduler.POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; choose from {sorted(scheduler.POLICIES)}")
    if not 0 <= args.fairness <= 1:
        raise ValueError(f"--fairness must be in [0, 1], got {args.fairness}")
    if not 0 < args.round_s < math.inf:
        raise ValueError(f"--round-s must be positive, finite seconds, got {args.round_s}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be a positive number of jobs, got {args.limit}")
    preflight.check_writable(args.gavel_json, "gavel-json")
    if args.trace:
        path = bundled("data") / "traces" / BUNDLED[args.trace] if args.trace in BUNDLED \
            else args.trace
        if not os.path.isfile(path):
            raise ValueError(f"--trace {args.trace!r}: no such file (a file, or one of "
                             f"{', '.join(BUNDLED)})")
        jobs = scheduler.read_trace(path, seed=args.seed, limit=args.limit)
        source = f"trace {args.trace}"
    else:
        jobs = scheduler.generate(args.jobs, args.jobs_per_hour, seed=args.seed)
        source = f"{args.jobs} jobs at {args.jobs_per_hour:g} an hour (Gavel's distribution)"
    matrix = scheduler.throughput_matrix(jobs, cluster)
    print(f"{source} | cluster {', '.join(f'{n} x {k}' for k, n in cluster.items())} | rounds of "
          f"{args.round_s:g} s | throughputs from minipar's planner")
    if args.gavel_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.gavel_json)), exist_ok=True)
        with open(args.gavel_json, "w") as f:
            f.write(scheduler.to_gavel(jobs, matrix))
        print(f"throughput matrix (Gavel's JSON): {args.gavel_json}")
    rows = [scheduler.simulate(jobs, cluster, p, args.round_s, rates=matrix,
                               fairness=args.fairness).row() for p in policies]
    print(table(rows))


def table(rows: list[dict]) -> str:
    """The metrics rows as aligned text."""
    head = list(rows[0])
    cells = [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    width = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, width))  # noqa: E731
    return "\n".join([line(head), *(line(c) for c in cells)])
