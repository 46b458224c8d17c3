"""Workers of lesson 01 (data parallelism): what bucketing and overlap each buy, timed apart.

    time_sync(cfg, ...)          a training step of every variant, interleaved, in one launch
    slowest(by_rank, key)        each repetition's time on its slowest rank

A launched function must live in a module: `launch` starts processes that import it by name.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minipar import comm
from minipar.data_parallel import DataParallelBucket, DataParallelNaive, GradBuckets, buckets_of
from minipar.model import GPT, cross_entropy
from minipar.lessons.demos import sync_device, synthetic_batch
from minipar.train import make_optimizer

def _now() -> float:
    """perf_counter once the queued GPU work is done (nothing to wait for on CPU)."""
    sync_device()
    return time.perf_counter()


def _sync(model, bucket_mb: float | None, overlap: bool, stats: comm.CommStats) -> GradBuckets:
    """The gradient sync of one variant, minipar's ring on a communication thread. bucket_mb None:
    DataParallelNaive (a bucket per tensor, model order, after backward); 0: a bucket per tensor in
    backward's order (`split` starts a new bucket at every parameter); else buckets of about that
    many MiB. overlap: launch each bucket as backward completes it (DataParallelBucket), or all of
    them in finish() (GradBuckets(overlap=False))."""
    if bucket_mb is None:
        return DataParallelNaive(model, None, stats=stats)
    if overlap:
        return DataParallelBucket(model, None, int(bucket_mb * 2**20), stats=stats)
    params = [p for p in model.parameters() if p.requires_grad]
    return GradBuckets(params, buckets_of(params, int(bucket_mb * 2**20), 4), None,
                       overlap=False, stats=stats)


def time_sync(cfg="tiny", per_rank_batch: int = 4, variants=(), reps: int = 20,
              warmup: int = 3, threads: int | None = None) -> dict:
    """Time a training step of each variant, (bucket_mb, overlap) as `_sync` reads it.

    Each variant has its own copy of the model (same seed) and AdamW, and every rank takes its
    `per_rank_batch` rows of one fixed synthetic batch (the time does not depend on the tokens).
    A repetition runs one step of each variant, starting at a different one each time, so a busy
    machine slows them all alike; each step starts at a barrier. The first `warmup`
    repetitions are not kept. Returns this rank's {"forward", "backward", "wait", "step":
    {variant index: [seconds per kept repetition]}} ("wait": blocked in finish(), the
    communication backward did not hide; "step": forward to the end of the optimizer step),
    "messages": {index: all-reduces per step}, "buckets": {index: buckets}, "grad_diff": {index:
    relative difference of its first averaged gradients from the first variant's}.
    """
    cfg, device, x, y = synthetic_batch(cfg, per_rank_batch, threads)
    runs = []
    for bucket_mb, overlap in variants:
        torch.manual_seed(0)
        model, stats = GPT(cfg).to(device), comm.CommStats()
        sync = _sync(model, bucket_mb, overlap, stats)
        runs.append((model, sync, make_optimizer(model, 1e-3, 0.0), stats))
    out = {k: {i: [] for i in range(len(runs))} for k in ("forward", "backward", "wait", "step")}
    grads, order = {}, list(range(len(runs)))
    for rep in range(warmup + reps):
        k = rep % len(order)
        for i in order[k:] + order[:k]:
            model, sync, optimizer, _ = runs[i]
            dist.barrier()
            t0 = _now()
            loss = cross_entropy(model(x), y)
            t1 = _now()
            loss.backward()
            t2 = _now()
            sync.finish()
            t3 = _now()
            if rep == 0:  # every copy still holds the initial weights
                grads[i] = torch.cat([p.grad.flatten() for p in model.parameters()]).double().cpu()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if rep >= warmup:
                for key, seconds in zip(out, (t1 - t0, t2 - t1, t3 - t2, _now() - t0)):
                    out[key][i].append(seconds)
    for _, sync, _, _ in runs:
        sync.close()
    steps = warmup + reps
    out["messages"] = {i: run[3].calls["all_reduce"] // steps for i, run in enumerate(runs)}
    out["buckets"] = {i: len(run[1].buckets) for i, run in enumerate(runs)}
    out["grad_diff"] = {i: ((g - grads[0]).norm() / grads[0].norm()).item()
                        for i, g in grads.items()}
    return out


def slowest(by_rank: list[dict], key: str = "step") -> dict[int, list[float]]:
    """From `time_sync`'s results by rank: {variant: each repetition's time on its slowest rank}."""
    return {i: [max(ts) for ts in zip(*(r[key][i] for r in by_rank))] for i in by_rank[0][key]}
