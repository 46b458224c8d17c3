"""Worker functions for test_comm.py: they run on every rank under `minipar.launch`.

`run_all` calls each from-scratch collective of `minipar.comm` and torch.distributed's own on the same
inputs, and returns plain numbers per case (errors against torch and against the exact sum, bytes
sent, calls made), so that the test process asserts on real values.

Inputs are made from a seed per (rank, case), so every rank can rebuild every other rank's input and
compute the exact answer itself, in float64, independently of either implementation:
  fp32: uniform in [1, 2): no cancellation, so a relative bound (~N ulp) holds for any summation order;
  bf16: small integers in [-4, 4]: every partial sum is exact in bf16, so any order gives equal bits.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from minipar import comm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_input(rank: int, shape: tuple, dname: str, tag: str) -> torch.Tensor:
    """The input rank `rank` uses in case `tag` (deterministic, so any rank can rebuild it)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{dname}/{tag}".encode()))
    if dname == "fp32":
        return torch.rand(shape, generator=g) + 1.0
    return torch.randint(-4, 5, shape, generator=g).to(torch.bfloat16)


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest relative difference of got from want; inf when shape or dtype differ."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    got, want = got.float(), want.float()  # exact for both dtypes' values here
    return (got - want).abs_().div_(want.abs().clamp_min_(1e-30)).max().item()


def _measure(run):
    """Run one minipar collective, `run(stats)`, counting into a fresh CommStats; return its output
    and what it sent."""
    stats = comm.CommStats()
    out = run(stats)
    return out, dict(stats.bytes_sent), dict(stats.calls)


def _inputs(ranks, shape, dname, tag):
    return [make_input(k, shape, dname, tag) for k in ranks]


def _exact_sum(inputs):
    return torch.stack([t.double() for t in inputs]).sum(0).to(inputs[0].dtype)


def all_reduce_case(shape, dname, tag, group=None, strided=False) -> dict:
    """comm.all_reduce vs dist.all_reduce; `strided`: the input is a non-contiguous view."""
    ranks = dist.get_process_group_ranks(group) if group else list(range(dist.get_world_size()))
    inputs = _inputs(ranks, shape, dname, tag)
    mine = inputs[ranks.index(dist.get_rank())]
    if strided:  # every other column of a wider tensor; the other columns must stay untouched
        base = torch.zeros(shape[0], 2 * shape[1], dtype=mine.dtype)
        base[:, ::2] = mine
        x = base[:, ::2]
    else:
        x = mine.clone()
    ref = mine.clone()
    dist.all_reduce(ref, group=group)
    out, sent, calls = _measure(lambda stats: comm.all_reduce(x, group, stats))
    res = {"vs_torch": error(x, ref), "vs_exact": error(x, _exact_sum(inputs)), "bytes": sent,
           "calls": calls, "in_place": out is x, "contiguous": x.is_contiguous()}
    if strided:
        res["untouched"] = bool((base[:, 1::2] == 0).all())
    return res


def broadcast_case(shape, dname, tag, src, group=None) -> dict:
    """comm.broadcast vs dist.broadcast from global rank `src`; every rank starts with other data."""
    x = make_input(dist.get_rank(), shape, dname, tag)
    ref = x.clone()
    dist.broadcast(ref, src, group=group)
    out, sent, calls = _measure(lambda stats: comm.broadcast(x, src, group, stats=stats))
    return {"vs_torch": error(x, ref), "vs_exact": error(x, make_input(src, shape, dname, tag)),
            "bytes": sent, "calls": calls, "in_place": out is x}


def all_gather_case(shape, dname, tag, group=None) -> dict:
    """comm.all_gather vs dist.all_gather (list form, concatenated on dim 0)."""
    ranks = dist.get_process_group_ranks(group) if group else list(range(dist.get_world_size()))
    inputs = _inputs(ranks, shape, dname, tag)
    x = inputs[ranks.index(dist.get_rank())].clone()
    parts = [torch.empty_like(x) for _ in ranks]
    dist.all_gather(parts, x, group=group)
    ref = torch.cat(parts) if x.dim() else torch.stack(parts)
    out, sent, calls = _measure(lambda stats: comm.all_gather(x, group, stats))
    exact = torch.cat(inputs) if x.dim() else torch.stack(inputs)
    return {"vs_torch": error(out, ref), "vs_exact": error(out, exact), "bytes": sent, "calls": calls,
            "input_kept": torch.equal(x, inputs[ranks.index(dist.get_rank())])}


def reduce_scatter_case(shape, dname, tag, group=None) -> dict:
    """comm.reduce_scatter vs dist.reduce_scatter when dim 0 divides evenly, else vs all_reduce + split."""
    ranks = dist.get_process_group_ranks(group) if group else list(range(dist.get_world_size()))
    n, me = len(ranks), ranks.index(dist.get_rank())
    inputs = _inputs(ranks, shape, dname, tag)
    x = inputs[me].clone()
    if shape[0] % n == 0:
        ref = torch.empty_like(x.chunk(n)[me])
        dist.reduce_scatter(ref, list(x.chunk(n)), group=group)
    else:
        total = x.clone()
        dist.all_reduce(total, group=group)
        ref = torch.tensor_split(total, n)[me]
    out, sent, calls = _measure(lambda stats: comm.reduce_scatter(x, group, stats))
    return {"vs_torch": error(out, ref), "vs_exact": error(out, torch.tensor_split(_exact_sum(inputs), n)[me]),
            "bytes": sent, "calls": calls, "input_kept": torch.equal(x, inputs[me])}


def run_all(lengths, subgroups, big=2**20) -> dict:
    """Every case for this world size; returns {(op, dtype, case...): result dict}.

    Broadcast runs from every src for lengths below `big` and from the last rank at `big`.
    `subgroups`: lists of global ranks that partition the world (every rank makes every group, in
    the same order, as dist.new_group requires); each rank then runs its own group's cases.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for dname in DTYPES:
        for length in lengths:
            shape = (length,)
            out["all_reduce", dname, length] = all_reduce_case(shape, dname, f"ar{length}")
            for src in range(n) if length < big else [n - 1]:
                out["broadcast", dname, length, src] = broadcast_case(shape, dname, f"bc{length}", src)
            out["all_gather", dname, length] = all_gather_case(shape, dname, f"ag{length}")
            out["reduce_scatter", dname, length] = reduce_scatter_case(shape, dname, f"rs{length}")
        for shape in [(3, 5), (2 * n + 1, 3, 4), (3 * n, 2), (1, 6)]:  # multi-dim; uneven dim 0 too
            out["all_gather", dname, shape] = all_gather_case(shape, dname, f"ag{shape}")
            out["reduce_scatter", dname, shape] = reduce_scatter_case(shape, dname, f"rs{shape}")
        out["all_gather", dname, ()] = all_gather_case((), dname, "ag0d")
        out["all_reduce_strided", dname, (7, 9)] = all_reduce_case((7, 9), dname, "strided", strided=True)
    posts_ahead, comm._posts_ahead = comm._posts_ahead, lambda group: False
    try:  # the path NCCL takes (each step's send and receive as one group), forced here on gloo
        for dname in DTYPES:
            for length in (7, 1000):
                out["grouped_all_reduce", dname, length] = all_reduce_case((length,), dname, f"gar{length}")
                out["grouped_broadcast", dname, length] = broadcast_case((length,), dname, f"gbc{length}", n - 1)
                out["grouped_all_gather", dname, length] = all_gather_case((length,), dname, f"gag{length}")
                out["grouped_reduce_scatter", dname, length] = reduce_scatter_case((length,), dname,
                                                                                   f"grs{length}")
    finally:
        comm._posts_ahead = posts_ahead
    groups = [dist.new_group(ranks) for ranks in subgroups]
    for ranks, group in zip(subgroups, groups):
        if rank not in ranks:
            continue
        for dname in DTYPES:
            for length in (7, 1000):
                out["sub_all_reduce", dname, length] = all_reduce_case((length,), dname, f"sar{length}", group)
                out["sub_broadcast", dname, length] = broadcast_case((length,), dname, f"sbc{length}",
                                                                     ranks[-1], group)
                out["sub_all_gather", dname, length] = all_gather_case((length,), dname, f"sag{length}", group)
                out["sub_reduce_scatter", dname, length] = reduce_scatter_case((length,), dname,
                                                                               f"srs{length}", group)
    return out
