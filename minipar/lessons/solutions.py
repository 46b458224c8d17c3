"""Reference answers to the exercises of `minipar.lessons.exercises`: a learner's answer, for the
tests and for the lessons' fallback when the exercise is not filled in; read it after trying.

    ring_reduce_scatter(tensor, dist)   lesson 00's exercise: check_reduce_scatter
    zb_h1_from_1f1b(p, m)               lesson 05's exercise: check_zb_h1
"""
from __future__ import annotations

import torch

from minipar.pipeline import Action
from minipar.pipeline.schedules import zb_h1


def ring_reduce_scatter(tensor: torch.Tensor, dist) -> torch.Tensor:
    """A learner's answer, for the tests; read it after trying.

    The ring: at step s (0 .. N-2) rank r sends its running sum of chunk (r-s-1) % N to the right
    and receives the left neighbour's running sum of chunk (r-s-2) % N, adds its own share of that
    chunk, and sends the result on at the next step. At the last step the chunk that arrives is
    chunk r, now summed over every rank (minipar.comm.ring_schedule's order)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor_split(tensor, n)  # this rank's shares, read only
    right, left = (rank + 1) % n, (rank - 1) % n
    ready = mine[(rank - 1) % n].clone()  # step 0 sends this rank's own share
    for s in range(n - 1):
        got = (rank - s - 2) % n
        incoming = torch.empty_like(mine[got])
        sending = dist.isend(ready, right)
        dist.irecv(incoming, left).wait()
        sending.wait()
        ready = incoming + mine[got]
    return ready


def zb_h1_from_1f1b(p: int, m: int) -> list[list[Action]]:
    """A learner's answer, for the tests; read it after trying. It is minipar's own generator,
    `pipeline.schedules.zb_h1` (`inspect.getsource` it): 1F1B's order of F and B on every rank;
    after each B its W joins a queue, and rank r lets at most r Ws wait there (running the oldest
    when there are more), running the rest after its last B."""
    return zb_h1(p, m)
