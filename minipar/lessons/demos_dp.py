"""Workers of lesson 01 (data parallelism): what bucketing and overlap each buy, timed apart, and
the exposed communication predicted from the latency-bandwidth model of the link.

    time_sync(cfg, ...)          a training step of every variant, interleaved, in one launch
    time_lesson(cfg, ...)        time_sync, then the ring alone at a few sizes and compare_ddp,
                                 in the same launch (one start of the processes for the lesson)
    slowest(by_rank, key)        each repetition's time on its slowest rank
    backward_per_bucket(...)     backward's time to complete each bucket, from its gradients
    predict_exposed(...)         per bucket: the all-reduce's time (alpha-beta), when it can start,
                                 and the part of it left after backward ends

A launched function must live in a module: `launch` starts processes that import it by name.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minipar import comm
from minipar.data_parallel import DataParallelBucket, DataParallelNaive, GradBuckets, buckets_of
from minipar.model import GPT, cross_entropy
from minipar.lessons.demos import compare_ddp, sync_device, synthetic_batch, time_all_reduce
from minipar.lessons.viz_collectives import ring_time
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
    them in finish() (GradBuckets(overlap=False)); None: no sync at all (the compute alone, the
    baseline every variant that communicates should be slower than)."""
    if overlap is None:
        return None
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
    "messages": {index: all-reduces per step}, "bytes": {index: all-reduce bytes sent per step},
    "buckets": {index: buckets}, "grad_diff": {index: relative difference of its first averaged
    gradients from the first variant's}, and per kept repetition, in seconds after backward
    began: "arrivals" {index: [[each parameter's gradient, model order]]} (a hook's time) and
    "spans" {index: [[(start, end) of each bucket's all-reduce, in the order sent]]}; and
    "bucket_params" {index: [[parameter indices of each bucket]]}, "bucket_bytes" {index: [bytes
    of each bucket]}, the real GradBuckets' buckets in the order they are sent.
    """
    # long: one timed loop over every variant in turn; cut up, its timers would be hard to follow
    cfg, device, x, y = synthetic_batch(cfg, per_rank_batch, threads)
    runs, arrived = [], []
    for bucket_mb, overlap in variants:
        torch.manual_seed(0)
        model, stats = GPT(cfg).to(device), comm.CommStats()
        sync = _sync(model, bucket_mb, overlap, stats)
        params = [p for p in model.parameters() if p.requires_grad]
        times = [0.0] * len(params)  # when each gradient arrived (after the sync's own hook)
        for j, p in enumerate(params):
            p.register_post_accumulate_grad_hook(
                lambda p, j=j, times=times: times.__setitem__(j, time.perf_counter()))
        runs.append((model, sync, make_optimizer(model, 1e-3, 0.0), stats))
        arrived.append(times)
    keys = ("forward", "backward", "wait", "step", "arrivals", "spans")
    out = {k: {i: [] for i in range(len(runs))} for k in keys}
    grads, order = {}, list(range(len(runs)))
    for rep in range(warmup + reps):
        k = rep % len(order)
        for i in order[k:] + order[:k]:
            model, sync, optimizer, _ = runs[i]
            spans = len(sync.spans) if sync else 0
            dist.barrier()
            t0 = _now()
            loss = cross_entropy(model(x), y)
            t1 = _now()
            loss.backward()
            t2 = _now()
            if sync:
                sync.finish()
            t3 = _now()
            if rep == 0:  # every copy still holds the initial weights
                grads[i] = torch.cat([p.grad.flatten() for p in model.parameters()]).double().cpu()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if rep >= warmup:
                for key, seconds in zip(keys, (t1 - t0, t2 - t1, t3 - t2, _now() - t0)):
                    out[key][i].append(seconds)
                out["arrivals"][i].append([t - t1 for t in arrived[i]])
                done = sync.spans[spans:] if sync else []
                out["spans"][i].append([(a - t1, b - t1) for what, a, b in
                                        sorted(done, key=lambda s: s[0]) if what != "wait"])
    for _, sync, _, _ in runs:
        if sync:
            sync.close()
    steps = warmup + reps
    out["messages"] = {i: run[3].calls["all_reduce"] // steps for i, run in enumerate(runs)}
    out["bytes"] = {i: run[3].bytes_sent["all_reduce"] // steps for i, run in enumerate(runs)}
    out["buckets"] = {i: len(run[1].buckets) if run[1] else 0 for i, run in enumerate(runs)}
    index = [{id(p): j for j, p in enumerate(run[0].parameters())} for run in runs]
    out["bucket_params"] = {i: [[index[i][id(p)] for p in b.params] for b in run[1].buckets]
                            if run[1] else [] for i, run in enumerate(runs)}
    out["bucket_bytes"] = {i: [b.numel * torch.empty(0, dtype=b.dtype).element_size()
                               for b in run[1].buckets] if run[1] else []
                           for i, run in enumerate(runs)}
    out["grad_diff"] = {i: ((g - grads[0]).norm() / grads[0].norm()).item()
                        for i, g in grads.items()}
    return out


def time_lesson(cfg="tiny", per_rank_batch: int = 4, variants=(), reps: int = 20,
                warmup: int = 3, ring_sizes=(), ring_samples: int = 5, ddp=(),
                bucket_mb: float = 0.1) -> dict:
    """Lesson 01's timings in one launch (the processes start once): {"sync": `time_sync`(...),
    "ring": [[seconds of minipar's ring all-reduce alone, one call right after an untimed one,
    per sample] for each size of ring_sizes (bytes)], "ddp": `demos.compare_ddp` of the variants
    `ddp` at `bucket_mb` (None when ddp is empty)}."""
    out = {"sync": time_sync(cfg, per_rank_batch, variants, reps, warmup)}
    plan = [size for size in ring_sizes for _ in range(ring_samples)]
    ring = time_all_reduce(plan, 1)["minipar"] if plan else []
    out["ring"] = [ring[j * ring_samples:(j + 1) * ring_samples] for j in range(len(ring_sizes))]
    out["ddp"] = compare_ddp(cfg, per_rank_batch, bucket_mb, reps, warmup, None, tuple(ddp)) \
        if ddp else None
    return out


def slowest(by_rank: list[dict], key: str = "step") -> dict[int, list[float]]:
    """From `time_sync`'s results by rank: {variant: each repetition's time on its slowest rank}."""
    return {i: [max(ts) for ts in zip(*(r[key][i] for r in by_rank))] for i in by_rank[0][key]}


# ----------------------------------------------------------------------------- the prediction

def backward_per_bucket(arrivals: list[float], buckets: list[list[int]]) -> list[float]:
    """Backward's seconds to complete each bucket, in the order sent: bucket b is complete when
    the last of its parameters' gradients has arrived (`arrivals[i]`: seconds after backward
    began, parameter i); the time from the bucket before's completion (from backward's start,
    the first)."""
    ready, done = [], 0.0
    for bucket in buckets:
        done = max(done, *(arrivals[i] for i in bucket))
        ready.append(done)
    return [t - s for t, s in zip(ready, [0.0, *ready[:-1]])]


def predict_exposed(bucket_bytes: list[int], backward_s: list[float], alpha: float, beta: float,
                    n: int, overlap: bool = True) -> list[dict]:
    """Per bucket, in the order sent, when its all-reduce runs and how much of it is exposed.

    bucket_bytes: each bucket's bytes; backward_s: backward's seconds to complete each
    (`backward_per_bucket`), so backward ends at their sum; alpha, beta: the link's latency (s)
    and bandwidth (bytes/s) in `viz_collectives.ring_time`, the all-reduce's time on n ranks.
    Bucket b can start when it is complete (`overlap`; else when backward ends) and the bucket
    before has finished (one communication thread sends them one at a time). Returns per bucket
    {"bytes", "ready", "start", "all_reduce", "end", "exposed"}, seconds from backward's start;
    "exposed": the part of its all-reduce after backward ends, which the step waits for.
    """
    rows, ready, free = [], 0.0, 0.0
    end = sum(backward_s)
    for size, compute in zip(bucket_bytes, backward_s):
        ready += compute
        start = max(ready if overlap else end, free)
        seconds = float(ring_time(alpha, beta, size, n))
        free = start + seconds
        rows.append(dict(bytes=size, ready=ready, start=start, all_reduce=seconds, end=free,
                         exposed=max(0.0, free - max(start, end))))
    return rows
