"""Lesson 05's worker: every action of every step of a pipeline, timed on each rank (a module, so
that the processes `minipar.launch` starts can import it)."""
from __future__ import annotations

import time

from minipar.train import train_rank


def timed_steps(cfg, layouts: list, steps: int, global_batch: int,
                return_state: bool = False) -> list[tuple]:
    """Worker for minipar.launch: train `cfg` under each pipeline ParallelConfig of `layouts`, one
    after the other (train_rank, what minipar.train runs on every rank), and time every action of
    every step. Returns, per layout, (this rank's RankResult, [per step: [(Action, start, end)]]),
    times in perf_counter seconds. RankResult.spans has the last step only; here train_rank's
    after_compute hook, called after each action with the seconds it computed (from the moment its
    inputs had arrived), gives every step's: the action's end is the call, its start that much
    earlier. The actions repeat in each step in the order of this rank's schedule."""
    out = []
    for par in layouts:
        times = []

        def hook(seconds, times=times):
            end = time.perf_counter()
            times.append((end - seconds, end))

        res = train_rank(cfg=cfg, par=par, steps=steps, global_batch=global_batch,
                         return_state=return_state, after_compute=hook)
        actions = [a for a, _, _ in res.spans]
        n = len(actions)
        if len(times) != n * steps:
            raise RuntimeError(f"{len(times)} actions timed, expected {n} a step for {steps} steps")
        out.append((res, [[(a, *t) for a, t in zip(actions, times[k * n:(k + 1) * n])]
                          for k in range(steps)]))
    return out
