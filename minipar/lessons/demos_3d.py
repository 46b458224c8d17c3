"""Worker functions for the 3D-parallelism lesson (06): `minipar.launch(demos_3d.layouts, 8, ...)`,
and `measured`, the same with the planner's calibration of this machine first, resumed jobs after,
and no step watched by a memory tracker.

They live in a module for the reason `demos.py` gives: `launch` starts fresh processes, which import
the function by name. Each returns plain data (lists, dicts) for the notebook to check.
"""
from __future__ import annotations

import torch

from minipar.train import train_layouts


def layouts(cfg, pars: list, steps: int, global_batch: int, lr: float = 1e-3,
            weight_decay: float = 0.0,
            save: dict | None = None, return_state: bool = False, watch: bool = True) -> list:
    """Train `cfg` under each ParallelConfig of `pars` (all of this world's size) in this one job,
    with what `minipar.train` runs on every rank (`train_layouts`), one layout after the other, each
    building its own grid and groups. One launch for many layouts: on a small CPU a launch of 8
    ranks costs seconds, a step of a tiny model milliseconds. save: {index in pars: path}, where
    that layout also writes a checkpoint after its last step
    (checkpoint.py: any layout can resume it).

    Returns, per layout, this rank's RankResult: .memory {category: bytes} measured at the first
    step, .step_times seconds per step, .losses the global mean loss of each step, .comm {collective
    or "p2p": bytes sent over all the steps}, and with return_state .state_dict the single-device
    weights (rank 0's; None elsewhere); with watch, .step_memory, the second step's peaks as a
    Tracker watched them (train_rank's `watch`).
    """
    torch.set_num_threads(1)  # 8 ranks on a few cores: one thread each, or
                              #   they fight over the cores
    jobs = [dict(par=par, save=(save or {}).get(i)) for i, par in enumerate(pars)]
    return train_layouts(jobs, cfg=cfg, steps=steps, global_batch=global_batch, lr=lr,
                         weight_decay=weight_decay, return_state=return_state, watch=watch)


def measured(cfg, pars: list, steps: int, global_batch: int, lr: float = 1e-3,
             weight_decay: float = 0.0, save: dict | None = None, return_state: bool = False,
             then: tuple = ()) -> dict:
    """This machine measured for the planner, then `layouts`, then the jobs of `then`, in one
    launch, no step watched by a Tracker (the lesson reads none: it would double a step). First what
    `planner.this_machine` measures in a launch of its own (calibrate.py's
    `machine_rank` on rank 0, then `link_rank`'s probes on every rank); then the
    layouts, as `layouts` trains them; then, after a barrier (a checkpoint `save` wrote is on
    disk), each job of `then`: a dict of train_rank's keyword arguments (par, and any of steps,
    resume...), with the layouts' common ones. Returns {"machine": machine_rank's dict, "links":
    link_rank's, "layouts": `layouts`' list, "then": the jobs' RankResults}, of which
    `calibrate.with_links(None, [r["links"] for r in ranks], ranks[0]["machine"])` makes a CPU."""
    import torch.distributed as dist

    from minipar.planner import calibrate
    machine, links = calibrate.machine_rank(), calibrate.link_rank()
    out = layouts(cfg, pars, steps, global_batch, lr, weight_decay, save, return_state, watch=False)
    dist.barrier()
    done = train_layouts(list(then), cfg=cfg, steps=steps, global_batch=global_batch, lr=lr,
                         weight_decay=weight_decay, return_state=return_state,
                         watch=False) if then else []
    return {"machine": machine, "links": links, "layouts": out, "then": done}
