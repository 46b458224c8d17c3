"""Collectives from scratch: ring reduce-scatter, all-gather, all-reduce and a chain broadcast.

Everything here is written on point-to-point sends (`isend` / `irecv`), the only primitive a
network really offers, so that each collective can be read, stepped through and measured. The ring
algorithm is the one Baidu brought to deep learning (Gibiansky 2017) and that NCCL and gloo use for
large messages: cut the tensor into N chunks, pass chunks around the ring of N ranks, and every link
carries the same traffic at the same time, so the time does not grow with N.

    reduce-scatter: N-1 steps; at each, every rank sends one chunk to its right neighbour and adds
                    the chunk it receives from its left one. Afterwards rank r holds the sum of chunk r.
    all-gather:     N-1 steps of passing the finished chunks on, without adding.
    all-reduce:     reduce-scatter, then all-gather.

Cost per rank, for a tensor of S bytes in a group of N ranks (chunks as `torch.tensor_split` cuts
them, so any length works; the uneven remainder moves the figures by at most one element a step):
    reduce-scatter  sends (N-1)/N * S        all-gather (of an S/N-byte input)  sends (N-1)/N * S
    all-reduce      sends 2(N-1)/N * S       broadcast (chain)  sends S, except the last rank: 0
Time ~ steps * latency + bytes / bandwidth, so the ring is bandwidth-optimal but pays 2(N-1) latencies.

The chunk each rank sends and receives at each step is data (`ring_schedule`), the same data the
lesson draws; `count()` records the bytes each rank sends, by collective.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- byte counting


@dataclass
class CommStats:
    """Bytes sent and calls made by this rank, keyed by collective ("all_reduce", "p2p", ...)."""
    bytes_sent: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)


_active_counters: list[CommStats] = []  # the open `count()` blocks of this process, innermost last


@contextlib.contextmanager
def count():
    """Count what this rank sends inside the block: `with comm.count() as stats: ...`."""
    stats = CommStats()
    _active_counters.append(stats)
    try:
        yield stats
    finally:
        _active_counters.remove(stats)


def record(kind: str, nbytes: int = 0, calls: int = 0) -> None:
    """Add bytes sent (and calls made) under `kind` to every open counter."""
    for stats in _active_counters:
        stats.bytes_sent[kind] += nbytes
        stats.calls[kind] += calls


# ----------------------------------------------------------------------------- the ring as data


def ring_schedule(n: int, phase: str) -> list[list[tuple[int, int]]]:
    """For each of the n-1 steps, for each rank, (chunk sent to the right, chunk received from the left).

    phase "reduce-scatter": rank r receives chunk r at the last step, so it ends owning chunk r.
    phase "all-gather":     rank r starts owning chunk r and passes on what it last received.
    """
    shift = 1 if phase == "reduce-scatter" else 0
    if phase not in ("reduce-scatter", "all-gather"):
        raise ValueError(f"phase must be 'reduce-scatter' or 'all-gather', got {phase!r}")
    return [[((r - s - shift) % n, (r - s - shift - 1) % n) for r in range(n)] for s in range(n - 1)]


# ----------------------------------------------------------------------------- point-to-point


def _group_info(group) -> tuple[int, int, list[int]]:
    """(rank in group, group size, global ranks of the group) for `group` (None: the world)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.get_rank(group), len(ranks), ranks


def _exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int, group, kind: str):
    """Send to global rank dst while receiving from global rank src; either side may be absent."""
    ops = []
    if send is not None and send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
        record(kind, send.numel() * send.element_size())
    if recv is not None and recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _ring(chunks: list[torch.Tensor], phase: str, group, kind: str) -> None:
    """Run one ring phase in place over `chunks` (one per rank of the group, possibly uneven)."""
    rank, n, ranks = _group_info(group)
    right, left = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    buffer = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    for step in ring_schedule(n, phase):
        send_i, recv_i = step[rank]
        if phase == "all-gather":
            _exchange(chunks[send_i], right, chunks[recv_i], left, group, kind)
        else:
            incoming = buffer[: chunks[recv_i].numel()].view_as(chunks[recv_i])
            _exchange(chunks[send_i], right, incoming, left, group, kind)
            chunks[recv_i].add_(incoming)


# ----------------------------------------------------------------------------- collectives


def reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over the group of `tensor`, and this rank's part of it: `tensor_split(sum, n)[rank]`."""
    record("reduce_scatter", calls=1)
    rank, n, _ = _group_info(group)
    work = tensor.detach().clone().contiguous()
    chunks = list(torch.tensor_split(work, n))
    if n > 1:
        _ring(chunks, "reduce-scatter", group, "reduce_scatter")
    return chunks[rank].clone()


def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's `tensor` (same shape everywhere) concatenated along dim 0, in rank order."""
    record("all_gather", calls=1)
    rank, n, _ = _group_info(group)
    piece = tensor.detach().reshape(1, -1) if tensor.dim() == 0 else tensor.detach()
    out = torch.empty((n * piece.shape[0], *piece.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    chunks = list(out.chunk(n))
    chunks[rank].copy_(piece)
    if n > 1:
        _ring(chunks, "all-gather", group, "all_gather")
    return out


def all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` in place across the group: ring reduce-scatter, then ring all-gather."""
    record("all_reduce", calls=1)
    _, n, _ = _group_info(group)
    if n == 1:
        return tensor
    flat = tensor.detach().view(-1) if tensor.is_contiguous() else tensor.detach().reshape(-1).clone()
    chunks = list(torch.tensor_split(flat, n))
    _ring(chunks, "reduce-scatter", group, "all_reduce")
    _ring(chunks, "all-gather", group, "all_reduce")
    if not tensor.is_contiguous():
        tensor.detach().copy_(flat.view_as(tensor))
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None, pieces: int = 8) -> torch.Tensor:
    """Copy src's `tensor` (src a global rank) to every rank, in place, along a pipelined chain.

    The chain starts at src and follows the ring; the tensor travels in `pieces` parts so that a
    rank forwards part i while it receives part i+1 (bandwidth-optimal for large tensors).
    """
    record("broadcast", calls=1)
    rank, n, ranks = _group_info(group)
    if src not in ranks:
        raise ValueError(f"broadcast src {src} is not in the group {ranks}")
    pos = (rank - ranks.index(src)) % n  # position along the chain, src = 0
    if n == 1:
        return tensor
    flat = tensor.detach().view(-1) if tensor.is_contiguous() else tensor.detach().reshape(-1).clone()
    parts = torch.tensor_split(flat, min(pieces, max(1, flat.numel())))
    right, left = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    pending = []
    for part in parts:
        if pos > 0:
            _exchange(None, right, part, left, group, "broadcast")
        if pos < n - 1 and part.numel():
            pending.append(dist.isend(part, right, group))
            record("broadcast", part.numel() * part.element_size())
    for work in pending:
        work.wait()
    if not tensor.is_contiguous():
        tensor.detach().copy_(flat.view_as(tensor))
    return tensor
