"""Lesson 06b's workers: ranks that go wrong on purpose, each the way real jobs go wrong.

They live in a module because `minipar.launch` starts fresh processes that import the function by
name (a function defined in a notebook cannot be imported). Each worker first prints its process id
(the lesson checks afterwards that no such process is left), then does a few lines of ordinary
torch.distributed with one mistake in them: a rank raises, a rank skips a collective, the ranks
disagree on a collective. The lesson launches them with a short `timeout` and reads what minipar,
gloo and torch report.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from minipar.launch import heartbeat


def _announce() -> int:
    """Print this worker's process id (it comes back as "[rank r] pid N"); return the rank."""
    print(f"pid {os.getpid()}", flush=True)
    return dist.get_rank()


def raise_on(bad_rank: int = 1) -> int:
    """Every rank joins an all-reduce except `bad_rank`, which raises first (an index past the end
    of its shard, say). The others wait in the all-reduce: until gloo sees bad_rank's connection
    close and fails it (the rank prints that, then raises too), or until the launcher stops them."""
    rank = _announce()
    if rank == bad_rank:
        shard = [3, 1, 4]
        return shard[rank + 4]  # IndexError: this rank's shard is shorter than it thought
    x = torch.ones(4)
    try:
        dist.all_reduce(x)  # waits for bad_rank, which never comes
    except RuntimeError as e:  # gloo saw bad_rank's connection close: say so, then fail too
        print(f"all_reduce failed: {str(e)[:160]}", flush=True)
        raise
    return int(x.sum())


def skip_collective(quiet_rank: int = 1, quiet_for: float = 30.0, patient: bool = True) -> float:
    """Every rank but `quiet_rank` all-reduces its loss (to log it, say); `quiet_rank` skips that
    line and goes on to work that prints nothing for `quiet_for` seconds. Nobody raises: the job
    just stops moving.

    patient=True: the all-reduce runs on a group whose own timeout is `quiet_for`, so what ends the
    job is launch's watchdog (no output for `timeout` s), as it would for a hang outside any
    collective. patient=False: it runs on launch's group, whose gloo timeout is launch's `timeout`,
    and the quiet rank calls heartbeat() as it works (so the watchdog stays quiet): then gloo gives
    up on the all-reduce and the waiting rank raises."""
    rank = _announce()
    group = dist.new_group(timeout=datetime.timedelta(seconds=quiet_for)) if patient else None
    loss = torch.tensor([float(rank)])
    if rank != quiet_rank:
        dist.all_reduce(loss, group=group)  # the quiet rank never joins
    else:
        _quiet_work(quiet_for, beat=not patient)
    return float(loss)


def _quiet_work(seconds: float, beat: bool) -> None:
    """Stand-in for work that prints nothing (a slow batch, an evaluation): sleep `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1)
        if beat:
            heartbeat()


def mismatch(sizes: tuple = (4, 8), ops: tuple = ("all_reduce", "all_reduce"),
             detail: bool = False) -> list:
    """Rank r runs collective ops[r] ("all_reduce" or "broadcast" from rank 0) on a tensor of
    sizes[r] elements: when the ranks' sizes or ops differ, they disagree on the collective.

    detail=True turns on TORCH_DISTRIBUTED_DEBUG=DETAIL first. torch reads that variable when its
    distributed module is imported, and minipar's workers are forked from a process that imported it
    before this function ran, so the worker sets it and has torch read it again
    (set_debug_level_from_env). Only groups created after that are checked, so the collective runs
    on a new group: each of its collectives is first compared across the ranks (op, shapes,
    dtypes, devices), and a difference raises on the spot."""
    rank = _announce()
    group = None
    if detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
        group = dist.new_group()
    x = torch.full((sizes[rank],), float(rank + 1))
    if ops[rank] == "all_reduce":
        dist.all_reduce(x, group=group)
    elif ops[rank] == "broadcast":
        dist.broadcast(x, 0, group=group)
    else:
        raise ValueError(f"ops must be 'all_reduce' or 'broadcast', got {ops[rank]!r}")
    return x.tolist()


def debug_setting() -> tuple:
    """(TORCH_DISTRIBUTED_DEBUG as this worker's environment has it, torch's debug level's name)."""
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG"), dist.get_debug_level().name
