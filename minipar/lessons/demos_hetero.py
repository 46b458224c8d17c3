"""Heterogeneous ranks on one machine: some ranks made slower on purpose, the planner's uneven plan
timed against the uniform layout in the same launch.

On a cluster of GPUs of different speeds (`minipar.Cluster.mixed`) the planner gives pipeline stages
layers, and DP ranks rows of the global batch, in proportion to their speed (planner/predict.py);
the executor runs such a plan as `ParallelConfig(stage_layers=..., dp_shares=...)`, still equal to
the single-process run (the DP gradient average is weighted by the shares, train.py).

The slow ranks are throttled: for the ranks of `slow_ranks={rank: factor}` this demo hands
train_rank `hardware.throttle(factor)` as its `after_compute` hook, so each computes like a device
`factor` times slower (hardware.py says what is slowed, and why a sleep; `throttle` is imported
here so that lesson 09 can print it).

    from minipar.lessons.demos_hetero import compare
    out = compare(cfg, minipar.ParallelConfig(dp=2), 48, slow_ranks={1: 2.0})
    out["planned"]["par"].dp_shares, out["ratio"]      # (32, 16), about 0.7: planned / uniform step

Device kinds, emulated and predicted (`emulated_run`): calibrate.emulate makes this machine's ranks
a mixed Cluster of kinds, each `slowdown` times slower (the throttle) with its own memory, and the
CPU cost model replays the throttle's sleeps, so the planner's placement (`placement`: every order
of the kinds, the layers split by speed and memory) is predicted and measured against the even
split:

    out = emulated_run(cfg, minipar.ParallelConfig(pp=2), 8, 1,
                       [("fast", 1, 1.0, 52 * 2**20), ("slow", 1, 3.0, 2**30)])
    out["speedup"], out["measured"], out["bound"]      # predicted, measured, compute alone
"""
from __future__ import annotations

import statistics

import torch.distributed as dist

from minipar import pipeline
from minipar.config import ParallelConfig
from minipar.hardware import throttle
from minipar.launch import launch
from minipar.mesh import layout_ranks
from minipar.planner import calibrate, estimate
from minipar.planner.cluster import Cluster
from minipar.planner.search import placements, rank, vendor_blind
from minipar.train import train_layouts


def cluster_of(speeds) -> Cluster:
    """A Cluster.mixed of one-GPU nodes, rank r computing at speeds[r] (relative: 1.0, 0.5, ...),
    memory and links ample: what the planner needs to split work in proportion to speed."""
    parts = [Cluster(gpus_per_node=1, nodes=1, memory_per_gpu=2.0**40, peak_flops=1e12 * s,
                     efficiency=1.0,
                     intra_bandwidth=1e10, intra_latency=1e-5, inter_bandwidth=1e10,
                     inter_latency=1e-5,
                     name=f"speed{s:g}") for s in speeds]
    return Cluster.mixed(parts)


def planned(cfg, par: ParallelConfig, global_batch: int, slow_ranks: dict) -> ParallelConfig:
    """`par` with the planner's uneven split for its world, rank r being slow_ranks.get(r, 1) times
    slower: `minipar.estimate` on `cluster_of` those speeds; its layers per chunk become
    stage_layers, its micro-batches per DP replica dp_shares. The planner is asked for micro-batches
    of par.microbatches rows, so that every share cuts into the executor's
    par.microbatches equal micro-batches."""
    cluster = cluster_of([1.0 / slow_ranks.get(r, 1.0) for r in range(par.world)])
    even = par.replace(stage_layers=None, dp_shares=None)
    est = estimate(cfg, even, cluster, global_batch, micro_batch=par.microbatches)
    return par.replace(stage_layers=tuple(est.layers) if par.pp > 1 else None,
                       dp_shares=tuple(s * par.microbatches for s in est.shares) if par.dp > 1
                       else None)


def race(cfg, layouts: list, steps: int, global_batch: int, slow_ranks: list, rounds: int = 5,
         lr: float = 1e-3, weight_decay: float = 0.0) -> list[dict]:
    """Worker (every rank): train each of `layouts` for `steps` steps, in turn, `rounds` times (a,
    b, a, b, ...), layout i's ranks slow_ranks[i] throttled (its order of the kinds). Returns per
    layout rank 0's step times, a list per round with each run's first step left out (warm-up),
    and "last": the last round's RankResult (its losses, and its single-device weights on rank
    0)."""
    rank = dist.get_rank()
    hooks = [throttle(float(slow.get(rank, 1.0))) for slow in slow_ranks]
    jobs = [dict(par=par, return_state=r == rounds - 1, after_compute=hook)
            for r in range(rounds) for par, hook in zip(layouts, hooks)]
    runs = train_layouts(jobs, cfg=cfg, steps=steps, global_batch=global_batch, lr=lr,
                         weight_decay=weight_decay, watch=False)
    n = len(layouts)  # runs: round 0's layouts, then round 1's, ...
    return [dict(rounds=[res.step_times[1:] for res in runs[i::n]], last=runs[i - n])
            for i in range(n)]


def compare(cfg, par: ParallelConfig, global_batch: int, slow_ranks: dict, steps: int = 5,
            rounds: int = 6,
            timeout: float = 600.0) -> dict:
    """Uniform `par` against `planned(...)`, both with `slow_ranks`
    throttled, in one launch (`race`).

    This machine may be shared: other work slows steps, by a factor that drifts within a second. Two
    verdicts stand up to it: "best_ratio", planned's fastest step over uniform's (other work only
    ever adds time, so a layout's fastest step is the closest to its own cost: timeit's reasoning),
    and "ratio", the median over rounds of planned's median step over uniform's in the same round
    (the layouts alternate round after round, so a round's pair saw about the same load).
    Returns {"best_ratio", "ratio", "uniform", "planned"}, each layout {"par", "median" (s a step,
    all rounds), "best", "rounds" (step times per round), "last" (the last round's RankResult)}."""
    plan = planned(cfg, par, global_batch, slow_ranks)
    ranks = launch(race, par.world, cfg, [par, plan], steps, global_batch, [slow_ranks] * 2,
                   rounds, timeout=timeout)
    return _verdicts(ranks[0], dict(uniform=par, planned=plan))


def _verdicts(results: list[dict], pars: dict) -> dict:
    """`race`'s rank-0 results of the layouts {"uniform", "planned"} (in that order), with their
    step times' medians and fastest, and the two verdicts of `compare`."""
    out = {}
    for (name, p), r in zip(pars.items(), results):
        times = [t for round_ in r["rounds"] for t in round_]
        out[name] = dict(par=p, median=statistics.median(times), best=min(times), **r)
    pairs = zip(out["planned"]["rounds"], out["uniform"]["rounds"])
    out["ratio"] = statistics.median(statistics.median(a) / statistics.median(b) for a, b in pairs)
    out["best_ratio"] = out["planned"]["best"] / out["uniform"]["best"]
    return out


def placement(cfg, par: ParallelConfig, cluster: Cluster, global_batch: int,
              micro_batch: int) -> dict:
    """The planner's placement of layout `par` on a mixed `cluster` against the vendor-blind one:
    {"planned": the fastest Estimate over the orders of the kinds (search.placements) with their
    layers and micro-batches split by speed (`estimate`), "uniform": par on the cluster in its
    own order, split evenly (search.vendor_blind; not timed if it does not fit), "speedup":
    predicted, uniform's step over planned's, "bound": `bound`'s}."""
    planned = rank([estimate(cfg, par, order, global_batch, micro_batch)
                    for order in placements(cluster)])[0]
    uniform = vendor_blind(planned, cluster)
    return dict(planned=planned, uniform=uniform, speedup=uniform.step_time / planned.step_time,
                bound=bound(uniform))


def _slowdowns(est) -> list[float]:
    """Each pipeline stage's slowdown: its slowest GPU's, the fastest kind's peak over its own."""
    par, cluster = est.par, est.cluster
    fastest = max(g.peak_flops for g in cluster.groups or (cluster,))
    return [max(fastest / g.peak_flops for g in cluster.parts_of(layout_ranks(par, r)))
            for r in range(par.pp)]


def bound(uniform) -> float:
    """The speed-up no split of the layers can beat, compute alone: `uniform`'s schedule simulated
    (pipeline.simulate) with each chunk's F, B and W its layers times its stage's slowdown
    (`_slowdowns`), for the even split over the same for the layers spread in proportion to each
    stage's speed (fractions of a layer allowed). The messages, the embeddings, the head and the
    optimizer are left out; 1 without a pipeline."""
    par, f = uniform.par, _slowdowns(uniform)
    p, v, m = par.pp, par.virtual_stages, uniform.shares[0]
    if p == 1:
        return 1.0
    ideal = [uniform.cfg.n_layer / v / f[c % p] / sum(1 / x for x in f) for c in range(p * v)]
    actions = pipeline.cached_schedule(par.schedule, p, m, v)

    def step(layers) -> float:
        cost = [n * f[c % p] for c, n in enumerate(layers)]
        return pipeline.simulate(actions, p, m, v, cost=dict(F=cost, B=cost, W=cost),
                                 checked=True).makespan
    return step(uniform.layers) / step(ideal)


def emulated_run(cfg, par: ParallelConfig, global_batch: int, micro_batch: int, kinds,
                 steps: int = 4, rounds: int = 4, timeout: float = 600.0) -> dict:
    """Device kinds emulated on this machine (calibrate.emulate: kinds = [(name, ranks, slowdown,
    memory bytes)] in rank order), the planner's `placement` of `par` run against the uniform one
    in one launch, each layout with its own order of the kinds' throttles (`race`). Returns
    `placement`'s dict, each of "uniform" and "planned" also with the measured times and "last"
    (`_verdicts`), and "measured": uniform's step over planned's, the median over rounds of
    each round's pair (the two run in turn, under about the same load), and "best": uniform's
    fastest step over planned's."""
    cluster = calibrate.emulate(calibrate.this_machine(world=par.world), kinds)
    out = placement(cfg, par, cluster, global_batch, micro_batch)
    ests = [out["uniform"], out["planned"]]
    for name, e in zip(("the even split", "the plan"), ests):  # each kind held to its memory
        if not e.fits:
            raise ValueError(f"{name} of {e.label} does not fit: {e.peak_memory / 2**20:.1f} MiB "
                             f"on a rank of {e.capacity / 2**20:.1f} MiB (an emulated kind's "
                             "memory)")
    run = [e.par.replace(stage_layers=tuple(e.layers) if e.par.pp > 1 else None) for e in ests]
    slow = [{r: e.cluster.device(r).cpu.slowdown for r in range(par.world)} for e in ests]
    ranks = launch(race, par.world, cfg, run, steps, global_batch, slow, rounds, timeout=timeout)
    measured = _verdicts(ranks[0], dict(uniform=run[0], planned=run[1]))
    for name, e in zip(("uniform", "planned"), ests):
        out[name] = dict(estimate=e, ranks=[r[name == "planned"]["last"] for r in ranks],
                         **measured[name])
    out["measured"], out["best"] = 1 / measured["ratio"], 1 / measured["best_ratio"]
    return out
