"""Heterogeneous ranks on one machine: some ranks made slower on purpose, the planner's uneven plan
timed against the uniform layout in the same launch.

On a cluster of GPUs of different speeds (`minipar.Cluster.mixed`) the planner gives pipeline stages
layers, and DP ranks rows of the global batch, in proportion to their speed (planner/predict.py);
the executor runs such a plan as `ParallelConfig(stage_layers=..., dp_shares=...)`, still equal to
the single-process run (the DP gradient average is weighted by the shares, train.py).

The throttle is stated and synthetic, and lives here: `throttle(factor)`, the `after_compute` hook
this demo hands to train_rank for the ranks of `slow_ranks={rank: factor}`. After each micro-batch's
forward and backward, or each pipeline action, a throttled rank sleeps (factor - 1) times what that
compute took, so it computes like a device `factor` times slower. It stands in for a slower GPU;
what is slowed is the forward and backward (with the TP or ZeRO-3 collectives inside them, if any),
not the DP all-reduce or the pipeline's sends, and sleeping frees the core, so the other ranks are
not slowed. Fewer intra-op threads would be the other way to slow a rank, but on a machine with as
many cores as ranks each rank has one thread already.

    from minipar.lessons.demos_hetero import compare
    out = compare(cfg, minipar.ParallelConfig(dp=2), 48, slow_ranks={1: 2.0})
    out["planned"]["par"].dp_shares, out["ratio"]      # (32, 16), about 0.7: planned / uniform step
"""
from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from minipar.config import ParallelConfig
from minipar.launch import launch
from minipar.planner import estimate
from minipar.planner.cluster import Cluster
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


def throttle(factor: float):
    """The after_compute hook of a device `factor` (>= 1) times slower: sleep (factor - 1) times the
    compute just done (sleeping frees the core for the other ranks). None for factor 1: no hook."""
    if not factor >= 1.0:
        raise ValueError(f"slow_ranks factors must be >= 1 (times slower), got {factor!r}")
    if factor == 1.0:
        return None
    return lambda seconds: time.sleep((factor - 1.0) * seconds)


def race(cfg, layouts: list, steps: int, global_batch: int, slow_ranks: dict, rounds: int = 5,
         lr: float = 1e-3, weight_decay: float = 0.0) -> list[dict]:
    """Worker (every rank): train each of `layouts` for `steps` steps, in turn, `rounds` times (a,
    b, a, b, ...), ranks `slow_ranks` throttled. Returns per layout rank 0's step times, a list per
    round with each run's first step left out (warm-up), and "last": the last round's RankResult
    (its losses, and its single-device weights on rank 0)."""
    hook = throttle(float(slow_ranks.get(dist.get_rank(), 1.0)))
    jobs = [dict(par=par, return_state=r == rounds - 1) for r in range(rounds) for par in layouts]
    runs = train_layouts(jobs, cfg=cfg, steps=steps, global_batch=global_batch, lr=lr,
                         weight_decay=weight_decay, after_compute=hook)
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
    ranks = launch(race, par.world, cfg, [par, plan], steps, global_batch, slow_ranks, rounds,
                   timeout=timeout)
    out = {}
    for name, p, r in zip(("uniform", "planned"), (par, plan), ranks[0]):
        times = [t for round_ in r["rounds"] for t in round_]
        out[name] = dict(par=p, median=statistics.median(times), best=min(times), **r)
    pairs = zip(out["planned"]["rounds"], out["uniform"]["rounds"])
    out["ratio"] = statistics.median(statistics.median(a) / statistics.median(b) for a, b in pairs)
    out["best_ratio"] = out["planned"]["best"] / out["uniform"]["best"]
    return out
