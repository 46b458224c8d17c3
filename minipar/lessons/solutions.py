"""Reference answers to the exercises of `minipar.lessons.exercises`: a learner's answer, for the
tests and for the lessons' fallback when the exercise is not filled in; read it after trying.

    ring_reduce_scatter(tensor, dist)   lesson 00's exercise: check_reduce_scatter
    zb_h1_from_1f1b(p, m)               lesson 05's exercise: check_zb_h1
    row_parallel(x_shard, weight, bias, dist)   lesson 04's: exercises_tp.check_row_parallel
    coords(rank, dp, tp, pp)            lesson 06's exercise: exercises_tp.check_coords
    pack_buckets(grads, bucket_bytes)   lesson 01's exercise: exercises_dp.check_pack
    sharded_adamw_step(flat_param, flat_grad, state, rank, world, lr, ...)   lesson 03's:
                                        exercises_zero.check_sharded_step
    loss_scale_update(scale, good_steps, found_inf, ...)   lesson 02's exercise:
                                        exercises_precision.check_loss_scaler
    ring_all_reduce_cost, ring_gather_cost (nbytes, n, link)   lesson 07's:
                                        exercises_planner.check_collective_costs
    split_layers(n_layer, seconds)      lesson 09's: exercises_planner.check_layer_split
    srtf(view)                          lesson 10's: exercises_scheduler.check_srtf
    merge_attention(out1, lse1, out2, lse2)   lesson 11's: exercises_cp_ep.check_merge
    route_with_capacity(scores, k, capacity)  lesson 12's: exercises_cp_ep.check_route
"""
from __future__ import annotations

import math

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


def row_parallel(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 dist) -> torch.Tensor:
    """Lesson 04's exercise (exercises_tp.check_row_parallel); read it after trying. Rank r's
    block of nn.Linear's (out, in) weight is its input-feature columns, the same cut as its input's
    last dimension; its product is one term of the sum, which one all-reduce (g) completes; the
    bias is added once, after the sum (RowParallelLinear.forward)."""
    rank, t = dist.get_rank(), dist.get_world_size()
    y = x_shard @ weight.tensor_split(t, dim=1)[rank].T   # (..., out): this rank's term
    dist.all_reduce(y)                                    # the sum over the ranks, in place
    return y + bias


def coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """Lesson 06's exercise (exercises_tp.check_coords); read it after trying. tp innermost, then
    dp, then pp: rank = (pp_rank * dp + dp_rank) * tp + tp_rank, read backwards."""
    return (rank // tp) % dp, rank % tp, rank // (tp * dp)


def pack_buckets(grads: list[tuple[str, int, int]], bucket_bytes: int) -> list[list[str]]:
    """Lesson 01's exercise (exercises_dp.check_pack); read it after trying. `data_parallel.split`'s
    rule on names: in the order given (backward's), a new bucket when the next gradient would take
    the current one past bucket_bytes; a bucket that is still empty takes any gradient, so one
    larger than the cap sits alone."""
    buckets, run, run_bytes = [], [], 0
    for name, numel, element_bytes in grads:
        size = numel * element_bytes
        if run and run_bytes + size > bucket_bytes:
            buckets.append(run)
            run, run_bytes = [], 0
        run.append(name)
        run_bytes += size
    return buckets + [run]


def sharded_adamw_step(flat_param: torch.Tensor, flat_grad: torch.Tensor, state: dict, rank: int,
                       world: int, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                       weight_decay: float = 0.0) -> torch.Tensor:
    """Lesson 03's exercise (exercises_zero.check_sharded_step); read it after trying. Pad the
    flat buffer to N equal shards of ceil(P/N) (zero.Flat), take shard `rank`, and run AdamW on it
    alone, its moments in `state`: torch.optim.AdamW's update, element by element."""
    size = -(-flat_param.numel() // world)  # ceil: zero.Flat.shard_size
    lo, pad = rank * size, size * world - flat_param.numel()
    p = torch.nn.functional.pad(flat_param, (0, pad))[lo:lo + size].clone()
    g = torch.nn.functional.pad(flat_grad, (0, pad))[lo:lo + size]
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    state["step"] += 1
    (beta1, beta2), t = betas, state["step"]
    state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p.mul_(1 - lr * weight_decay)  # decoupled weight decay, before the update
    denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(eps)
    return p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** t))


def loss_scale_update(scale: float, good_steps: int, found_inf: bool, *, growth: float = 2.0,
                      backoff: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """Lesson 02's exercise (exercises_precision.check_loss_scaler); read it after trying.
    precision.LossScaler.update's rule on its state: an overflow multiplies the scale by backoff
    and starts the count of good steps again; the good step that brings the count to
    growth_interval multiplies the scale by growth and starts it again too."""
    if found_inf:
        return scale * backoff, 0
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth, 0
    return scale, good_steps


def ring_all_reduce_cost(nbytes: float, n: int, link) -> float:
    """Lesson 07: a ring all-reduce is a reduce-scatter then an all-gather, 2(n-1) steps, each rank
    sending 2(n-1)/n of the bytes (lesson 00); one rank sends nothing."""
    return 2 * ring_gather_cost(nbytes, n, link)


def ring_gather_cost(nbytes: float, n: int, link) -> float:
    """Lesson 07: a ring all-gather or reduce-scatter, n-1 steps, (n-1)/n of the bytes a rank."""
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def split_layers(n_layer: int, seconds: list[float]) -> list[int]:
    """Lesson 09: the least time T that the slowest stage can take is one of the n * seconds[r];
    try them smallest first, filling each stage with as many layers as fit in T (at least one,
    leaving one for each stage after it); the first T whose fill takes every layer wins."""
    k = len(seconds)
    for bound in sorted({n * s for s in seconds for n in range(1, n_layer + 1)}):
        layers, left = [], n_layer
        for r, s in enumerate(seconds):
            rest = k - 1 - r     # stages after this one, a layer each
            n = min(int(bound / s + 1e-9), left - rest) if rest else left
            if n < 1 or n * s > bound + 1e-9:
                break
            layers.append(n)
            left -= n
        else:
            return layers
    raise ValueError(f"{k} stages cannot split {n_layer} layers")


def srtf(view) -> dict:
    """Lesson 10: shortest remaining time first. Each job's remaining steps at its best rate at its
    scale orders the jobs (least first; sorted is stable, so ties keep arrival order); each takes
    its scale on the fastest kind with room, as LAS does, or is passed over."""
    def left(s):
        best = max(view.rate(s, kind, s.job.scale) for kind in view.capacity)
        return s.remaining / best if best > 0 else math.inf

    free, alloc = dict(view.capacity), {}
    for s in sorted(view.jobs, key=left):
        kind = view.fastest(s, free, s.job.scale)
        if kind is not None:
            alloc[s.job.name] = (kind, s.job.scale)
            free[kind] -= s.job.scale
    return alloc


def merge_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, as one: each weighted by its
    share of the total exp-sum, computed from differences of log-sum-exps (no overflow); a block
    whose keys a query cannot see (lse -inf) weighs 0."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    return out1 * torch.exp(lse1 - safe)[..., None] + out2 * torch.exp(lse2 - safe)[..., None], lse


def route_with_capacity(scores: torch.Tensor, k: int, capacity: int):
    """Each token's k best experts, and whether each slot fits: an expert takes its first
    `capacity` slots in token order."""
    experts = torch.topk(scores, k, dim=-1).indices
    taken = [0] * scores.shape[1]
    kept = torch.zeros_like(experts, dtype=torch.bool)
    for t in range(len(experts)):
        for j in range(k):
            e = int(experts[t, j])
            kept[t, j] = taken[e] < capacity
            taken[e] += 1
    return experts, kept
