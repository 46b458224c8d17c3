"""The layers of a pipeline split over stages of different speed: the split whose slowest chunk is
fastest, by dynamic programming (what `predict.split_layout` starts a mixed cluster's plan from).

Chunk c (of pp * virtual_stages, in model order) runs on pipeline rank c % pp, whose GPUs take
`layer[c]` seconds a layer per micro-batch (forward, backward, weight gradients: gpu_time's chunk
cost), plus `emb[c]` if it is the first chunk and `head[c]` if it is the last. `min_max` finds the
layers per chunk that minimise the largest chunk time, over all splits with at least one layer a
chunk: O(chunks l^2). Memory is not a constraint here: `split_layout` then moves layers out of
stages that overflow, and `refine` searches the neighbouring splits under the whole step's model.
"""
from __future__ import annotations

import functools

from minipar.mesh import grid_ranks
from minipar.planner.gpu_time import chunk_cost, work_on


def min_max(n_layer: int, layer, emb, head) -> list[int]:
    """Layers per chunk (len(layer) chunks, each >= 1, summing to n_layer) minimising the largest
    chunk time: n layer[c] + emb[c] on the first chunk + head[c] on the last."""
    return list(_min_max(n_layer, tuple(layer), tuple(emb), tuple(head)))


@functools.lru_cache(maxsize=4096)
def _min_max(n_layer: int, layer: tuple, emb: tuple, head: tuple) -> tuple:
    """min_max, cached: a plan's layouts that differ only in what does not change a chunk's time
    (the schedule, ZeRO, the micro-batch count...) split alike."""
    chunks = len(layer)
    if not 1 <= chunks <= n_layer:
        raise ValueError(f"{chunks} chunks cannot split {n_layer} layers (one at least each)")
    cost = lambda c, a, b: (b - a) * layer[c] + emb[c] * (a == 0) + head[c] * (b == n_layer)

    @functools.lru_cache(maxsize=None)
    def best(c: int, a: int) -> tuple[float, tuple]:
        """(least largest time, sizes) of chunks c.. holding layers [a, n_layer)."""
        if c == chunks - 1:
            return cost(c, a, n_layer), (n_layer - a,)
        options = []
        for b in range(a + 1, n_layer - (chunks - 1 - c) + 1):  # the chunks after need a layer each
            rest, sizes = best(c + 1, b)
            options.append((max(cost(c, a, b), rest), (b - a, *sizes)))
        return min(options)
    return best(0, 0)[1]


def chunk_seconds(cfg, par, cluster, b: int, attention: str) -> tuple[list, list, list]:
    """(layer, emb, head) seconds of each chunk per micro-batch of b sequences on its stage's GPUs
    (`gpu_time.work_on`: the slowest of them), from gpu_time's chunk cost: min_max's inputs."""
    out = ([], [], [])
    for c in range(par.pp * par.virtual_stages):
        w = work_on(cluster, grid_ranks(par.dp, par.tp, par.pp, pp_rank=c % par.pp), par, b,
                    attention)
        seconds = [sum(v for op in chunk_cost(cfg, w, n, first, last).values() for v in op.values())
                   for n, first, last in ((1, False, False), (0, True, False), (0, False, True))]
        for part, s in zip(out, seconds):
            part.append(s)
    return out
