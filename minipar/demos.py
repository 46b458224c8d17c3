"""Small worker functions the lessons run on several ranks: `minipar.launch(demos.hello, 4)`.

They live in a module because `launch` starts fresh processes that import the function by name (a
function defined in a notebook cannot be imported). Each one reads its rank from torch.distributed,
prints what a lesson wants to show (it comes back as "[rank r] ..."), and returns plain data (lists,
dicts, CPU tensors) for the notebook to check. Tensors live on the rank's GPU under NCCL, else on CPU.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from minipar import comm


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL (launch set it), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync() -> None:
    """Wait for queued GPU work, so a timer measures it (nothing to wait for on CPU)."""
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def _in_turn(text: str) -> None:
    """Print `text` on every rank, rank 0 first: a barrier between turns keeps the lines in order."""
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            print(text, flush=True)
        dist.barrier()


# ----------------------------------------------------------------------------- lesson 00


def hello() -> tuple[int, int, int]:
    """Say hello from this rank; return (rank, world size, process id)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"hello from rank {rank} of {world}, process {os.getpid()}, backend {dist.get_backend()}")
    return rank, world, os.getpid()


def collective(name: str, length: int = 4, src: int = 0) -> dict:
    """Run one collective, minipar's and torch.distributed's, on a rank-dependent tensor.

    Rank r starts with [10r, 10r+1, ...] (so each value says where it came from), prints what it
    holds before and after, and returns {"before", "minipar", "torch"} as CPU tensors.
    name: "all_reduce", "reduce_scatter", "all_gather" or "broadcast" (from global rank src).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    x = (torch.arange(length) + 10 * rank).float().to(_device())
    if name == "all_reduce":
        ours, ref = comm.all_reduce(x.clone()), x.clone()
        dist.all_reduce(ref)
    elif name == "broadcast":
        ours, ref = comm.broadcast(x.clone(), src), x.clone()
        dist.broadcast(ref, src)
    elif name == "all_gather":
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
        ours, ref = comm.all_gather(x), torch.cat(parts)
    elif name == "reduce_scatter":
        ours = comm.reduce_scatter(x)
        if length % n == 0:
            ref = x.new_empty(length // n)
            dist.reduce_scatter_tensor(ref, x)
        else:  # torch needs equal parts: sum everything, then take this rank's tensor_split part
            ref = x.clone()
            dist.all_reduce(ref)
            ref = torch.tensor_split(ref, n)[rank]
    else:
        raise ValueError(f"unknown collective {name!r}")
    _in_turn(f"before {x.tolist()}  ->  after {ours.tolist()}")
    return {"before": x.cpu(), "minipar": ours.cpu(), "torch": ref.cpu()}


def ring_trace(length: int | None = None) -> dict:
    """Step the ring all-reduce by hand, recording what this rank holds after every step.

    Rank r contributes 2**r to every element, so a value is a bit mask of the ranks summed into
    it (0b0101: ranks 0 and 2). The steps follow `comm.ring_schedule`, the same schedule comm's ring
    runs, with a pause after each to look; then comm's own all_reduce and reduce_scatter run on the
    same input. Returns {"steps": per step (start first), the mask of each chunk's first element,
    "all_reduce": comm.all_reduce's result, "reduce_scatter": comm.reduce_scatter's}, as lists.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    length = length or n
    x = torch.full((length,), 2 ** rank, dtype=torch.int64, device=_device())
    work = x.clone()
    chunks = list(torch.tensor_split(work, n))  # views into work, uneven when n does not divide length
    right, left = (rank + 1) % n, (rank - 1) % n
    steps = [[int(c[0]) for c in chunks]]
    for phase in ("reduce-scatter", "all-gather"):
        for moves in comm.ring_schedule(n, phase):
            send, recv = moves[rank]
            incoming = torch.empty_like(chunks[recv])
            ops = [dist.P2POp(dist.isend, chunks[send], right), dist.P2POp(dist.irecv, incoming, left)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            if phase == "reduce-scatter":
                chunks[recv].add_(incoming)  # reduce: add the partial sum that arrived
            else:
                chunks[recv].copy_(incoming)  # gather: take the finished chunk as it is
            steps.append([int(c[0]) for c in chunks])
    return {"steps": steps, "all_reduce": comm.all_reduce(x.clone()).tolist(),
            "reduce_scatter": comm.reduce_scatter(x).tolist()}


def count_bytes(lengths: list[int]) -> list[dict]:
    """Bytes this rank sends in each of comm's collectives, for fp32 tensors of each length.

    all_reduce and reduce_scatter take a tensor of `length` elements; all_gather takes `length`
    elements per rank, so its output (the S of its formula) has world * length. Returns, per length,
    {collective: bytes sent}.
    """
    out = []
    for length in lengths:
        x = torch.ones(length, device=_device())
        with comm.count() as stats:
            comm.all_reduce(x)
            comm.reduce_scatter(x)
            comm.all_gather(x)
        out.append(dict(stats.bytes_sent))
    return out


def time_all_reduce(sizes: list[int], reps: int = 5) -> dict[str, list[float]]:
    """Best-of-`reps` seconds of an fp32 all-reduce of each size (bytes): minipar's ring and the backend's.

    Every rank waits at a barrier before each repetition, so they start together; one warm-up call
    per size is not timed. The minimum, not the mean, because on a shared machine another process
    can stall a rank for a scheduler tick (4 ms) in any repetition. Returns {"minipar": [...],
    "<backend>": [...]}, one entry per size.
    """
    impls = {"minipar": comm.all_reduce, dist.get_backend(): dist.all_reduce}
    times = {name: [] for name in impls}
    for size in sizes:
        x = torch.ones(size // 4, device=_device())
        for name, fn in impls.items():
            fn(x)
            samples = []
            for _ in range(reps):
                dist.barrier()
                _sync()
                start = time.perf_counter()
                fn(x)
                _sync()
                samples.append(time.perf_counter() - start)
            times[name].append(min(samples))
    return times
