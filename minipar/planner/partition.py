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

from minipar.config import ParallelConfig
from minipar.mesh import layout_ranks
from minipar.planner.gpu_time import chunk_cost, work_on


def min_max(n_layer: int, layer, emb, head) -> list[int]:
    """Layers per chunk (len(layer) chunks, each >= 1, summing to n_layer) minimising the largest
    chunk time: n layer[c] + emb[c] on the first chunk + head[c] on the last."""
    return list(_min_max(n_layer, tuple(layer), tuple(emb), tuple(head)))


@functools.lru_cache(maxsize=4096)
def _min_max(n_layer: int, layer: tuple, emb: tuple, head: tuple) -> tuple:
    """min_max, cached: a plan's layouts that differ only in what does not change a chunk's time
    (the schedule, ZeRO, the micro-batch count...) split alike.

    Bottom-up: V[c][a], the least largest time of chunks c.. holding layers [a, n_layer), is the
    least over b of max(cost(c, a, b), V[c + 1][b]); the first term grows with b and the second
    does not (fewer layers for as many chunks), so the least is where they cross, found by
    bisection: O(chunks l log l). Of equal splits it keeps the one whose first chunk is smallest,
    then the next (the full search's order)."""
    chunks, n = len(layer), n_layer
    if not 1 <= chunks <= n:
        raise ValueError(f"{chunks} chunks cannot split {n} layers (one at least each)")
    # cost(c, a, b), the time of chunk c holding layers [a, b): (b - a) layer[c], + emb[c] if
    # a = 0, + head[c] if b = n (inlined below: the loops run 10^7 times in a large search)
    after = [0.0] * (n + 1)
    for a in range(chunks - 1, n):
        after[a] = (n - a) * layer[-1] + emb[-1] * (a == 0) + head[-1]
    choice = [None] * chunks
    for c in range(chunks - 2, -1, -1):
        value, choice[c], lc, hc = [0.0] * (n + 1), [0] * (n + 1), layer[c], head[c]
        for a in range(c, n - (chunks - c) + 1):
            ea = emb[c] * (a == 0)
            lo, hi = a + 1, n - (chunks - 1 - c)   # b in [lo, hi]: the first where cost >= after
            while lo < hi:
                mid = (lo + hi) // 2
                if (mid - a) * lc + ea + hc * (mid == n) >= after[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            best_b, best = lo, max((lo - a) * lc + ea + hc * (lo == n), after[lo])
            if lo > a + 1 and after[lo - 1] <= best:  # before the crossing: after[b] alone, and
                best = after[lo - 1]                  # the first b that reaches it
                first, last = a + 1, lo - 1
                while first < last:
                    mid = (first + last) // 2
                    first, last = (first, mid) if after[mid] <= best else (mid + 1, last)
                best_b = first
            value[a], choice[c][a] = best, best_b
        after = value
    sizes, a = [], 0
    for c in range(chunks - 1):
        sizes.append(choice[c][a] - a)
        a = choice[c][a]
    return (*sizes, n - a)


def slowest_chunk(n_layer: int, layer, emb, head) -> float:
    """The largest chunk time of min_max's split: the least it can be over all splits."""
    layers, last = min_max(n_layer, layer, emb, head), len(layer) - 1
    return max(n * x + e * (c == 0) + h * (c == last)
               for c, (n, x, e, h) in enumerate(zip(layers, layer, emb, head)))


def chunk_seconds(cfg, par, cluster, b: int, attention: str,
                  dp_rank: int | None = None) -> tuple[list, list, list]:
    """(layer, emb, head) seconds of each chunk per micro-batch of b sequences on its stage's GPUs
    (`gpu_time.work_on`: the slowest of them; dp_rank: of that replica's only), from gpu_time's
    chunk cost: min_max's inputs. What they do not depend on (ZeRO, the micro-batch count, the
    schedule but for zb-h1's split backward) is left out of the key of the cached computation: a
    plan asks for every variant."""
    zb, v = par.schedule == "zb-h1", par.virtual_stages
    timing = par.replace(zero=0, microbatches=1, stage_layers=None, dp_shares=None,
                         dp_mode="bucketed", bucket_mb=ParallelConfig.bucket_mb,
                         schedule="zb-h1" if zb else "interleaved-1f1b" if v > 1 else "1f1b")
    return _chunk_seconds(cfg, timing, cluster, b, attention, dp_rank)


@functools.lru_cache(maxsize=4096)
def _chunk_seconds(cfg, par, cluster, b: int, attention: str, dp_rank) -> tuple[list, list, list]:
    stages = [work_on(cluster, layout_ranks(par, r, dp_rank), par.at_stage(r), b, attention)
              for r in range(par.pp)]   # a stage's chunks run on its GPUs, at its tp
    seconds = [[sum(v for op in chunk_cost(cfg, w, n, first, last).values() for v in op.values())
                for w in stages] for n, first, last in ((1, False, False), (0, True, False),
                                                        (0, False, True))]
    return tuple([part[c % par.pp] for c in range(par.pp * par.virtual_stages)]
                 for part in seconds)
