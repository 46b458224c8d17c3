"""Worker functions for the 3D-parallelism lesson (06): `minipar.launch(demos_3d.layouts, 8, ...)`.

They live in a module for the reason `demos.py` gives: `launch` starts fresh processes, which import
the function by name. Each returns plain data (lists, dicts) for the notebook to check.
"""
from __future__ import annotations

import torch

from minipar.train import train_layouts


def layouts(cfg, pars: list, steps: int, global_batch: int, lr: float = 1e-3,
            weight_decay: float = 0.0,
            save: dict | None = None, return_state: bool = False) -> list:
    """Train `cfg` under each ParallelConfig of `pars` (all of this world's size) in this one job,
    with what `minipar.train` runs on every rank (`train_layouts`), one layout after the other, each
    building its own grid and groups. One launch for many layouts: on a small CPU a launch of 8
    ranks costs seconds, a step of a tiny model milliseconds. save: {index in pars: path}, where
    that layout also writes a checkpoint after its last step
    (checkpoint.py: any layout can resume it).

    Returns, per layout, this rank's RankResult: .memory {category: bytes} measured at the first
    step, .step_times seconds per step, .losses the global mean loss of each step, .comm {collective
    or "p2p": bytes sent over all the steps}, and with return_state .state_dict the single-device
    weights (rank 0's; None elsewhere).
    """
    torch.set_num_threads(1)  # 8 ranks on a few cores: one thread each, or
                              #   they fight over the cores
    jobs = [dict(par=par, save=(save or {}).get(i)) for i, par in enumerate(pars)]
    return train_layouts(jobs, cfg=cfg, steps=steps, global_batch=global_batch, lr=lr,
                         weight_decay=weight_decay, return_state=return_state)
