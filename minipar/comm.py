"""Collectives from scratch: ring reduce-scatter, all-gather, all-reduce and a chain broadcast.

Everything here is written on point-to-point sends (`isend` / `irecv`), the only primitive a
network really offers, so that each collective can be read, stepped through and measured. The ring
algorithm is the one Baidu brought to deep learning (Gibiansky 2017) and that NCCL and gloo use for
large messages: cut the tensor into N chunks, pass chunks around the ring of N ranks, and every link
carries the same traffic at the same time, so the time does not grow with N.

    reduce-scatter: N-1 steps; at each, every rank sends one chunk to its right neighbour and adds
                    the chunk it receives from its left one. Afterwards
                    rank r holds the sum of chunk r.
    all-gather:     N-1 steps of passing the finished chunks on, without adding.
    all-reduce:     reduce-scatter, then all-gather.

Cost per rank, for a tensor of S bytes in a group of N ranks (chunks as `torch.tensor_split` cuts
them, so any length works; the uneven remainder moves the figures by at most one element a step):
    reduce-scatter  sends (N-1)/N * S        all-gather (of an S/N-byte input)  sends (N-1)/N * S
    all-reduce      sends 2(N-1)/N * S       broadcast (chain)  sends S, except the last rank: 0
Time ~ steps * latency + bytes / bandwidth, so the ring is
bandwidth-optimal but pays 2(N-1) latencies.
Memory: reduce-scatter and all-reduce receive partial sums into (N-1)/N * S of scratch space: fresh
for each call, or a `Scratch` that the caller owns and passes, which keeps it for the next call;
nothing else beyond the results.

The chunk each rank sends and receives at each step is data (`ring_schedule`), the same data the
lesson draws; `all_reduce(..., observe=fn)` calls fn after each step with what arrived, so the
lesson traces this very ring. Counting is explicit: a caller makes a `CommStats` and passes it
(`stats=`) to what communicates, which adds the bytes it sends and the calls it makes, by
collective.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- byte counting


@dataclass
class CommStats:
    """Bytes sent and calls made by this rank, keyed by collective ("all_reduce", "p2p", ...).

    Made by whoever wants the counts (train_rank: one for the whole run) and handed to what
    communicates: `comm.all_reduce(x, group, stats)`, `DataParallelBucket(..., stats=stats)`..."""
    bytes_sent: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def record(self, kind: str, nbytes: int = 0, calls: int = 0) -> None:
        """Add bytes sent (and calls made) under `kind`."""
        self.bytes_sent[kind] += nbytes
        self.calls[kind] += calls


def _record(stats: CommStats | None, kind: str, nbytes: int = 0, calls: int = 0) -> None:
    if stats is not None:
        stats.record(kind, nbytes, calls)


# ----------------------------------------------------------------------------- the ring as data


def ring_schedule(n: int, phase: str) -> list[list[tuple[int, int]]]:
    """For each of the n-1 steps, for each rank, (chunk sent to the
    right, chunk received from the left).

    phase "reduce-scatter": rank r receives chunk r at the last step, so it ends owning chunk r.
    phase "all-gather":     rank r starts owning chunk r and passes on what it last received.
    """
    shift = 1 if phase == "reduce-scatter" else 0
    if phase not in ("reduce-scatter", "all-gather"):
        raise ValueError(f"phase must be 'reduce-scatter' or 'all-gather', got {phase!r}")
    return [[((r - s - shift) % n, (r - s - shift - 1) % n) for r in range(n)]
            for s in range(n - 1)]


# ----------------------------------------------------------------------------- point-to-point


def _group_info(group) -> tuple[int, int, list[int]]:
    """(rank in group, group size, global ranks of the group) for `group` (None: the world)."""
    world = list(range(dist.get_world_size()))
    ranks = dist.get_process_group_ranks(group) if group is not None else world
    return dist.get_rank(group), len(ranks), ranks


def isend(tensor: torch.Tensor, dst: int, group, kind: str, stats: CommStats | None = None,
          calls: int = 0):
    """Start sending to global rank dst and count the bytes in `stats` (and `calls`: a ring step is
    not a call of its own, a pipeline's message is); None for an empty tensor (nothing moves)."""
    if not tensor.numel():
        return None
    _record(stats, kind, tensor.numel() * tensor.element_size(), calls)
    return dist.isend(tensor, dst, group)


def irecv(tensor: torch.Tensor, src: int, group):
    """Start receiving from global rank src into `tensor`; None for an empty tensor."""
    return dist.irecv(tensor, src, group) if tensor.numel() else None


def wait(*works) -> None:
    """Wait for each started send or receive (None: nothing was started)."""
    for work in works:
        if work is not None:
            work.wait()


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group, kind: str,
              stats: CommStats | None) -> None:
    """Send to global rank dst and receive from global rank src as one group; wait for both."""
    ops = [dist.P2POp(dist.irecv, recv, src, group)] if recv.numel() else []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
        _record(stats, kind, send.numel() * send.element_size())
    wait(*(dist.batch_isend_irecv(ops) if ops else []))


def _posts_ahead(group) -> bool:
    """Whether receives may be posted long before the sends they wait on (True on gloo).

    gloo moves a message only once its receiver has posted the receive, and matches them on a
    background thread: posting every receive up front means no step waits on that handshake, and a
    late rank does not hold up its neighbours. NCCL instead runs the sends and receives with one
    peer in order on one stream, where an early receive would block the send queued behind it (a
    deadlock with 2 ranks): there each step's send and receive go out together as one group.
    """
    return dist.get_backend(group) == "gloo"


class Scratch:
    """Receive space that its owner keeps between calls, by (dtype, device), grown when needed.

    Why keep it: a fresh tensor of tens of MB costs a page fault per 4 KB page on first touch, which
    on a CPU takes longer than the additions the space is for (measured: 32 MB, 11 ms fresh vs 3 ms
    reused). One owner, one thread at a time (DataParallelBucket's communication thread, ZeRO's, a
    TP group's forward and backward): two calls in flight on one Scratch would share its space.
    """

    def __init__(self):
        self.buffers: dict = {}

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """`numel` elements of the space, of `like`'s dtype and device."""
        key = (like.dtype, like.device)
        if key not in self.buffers or self.buffers[key].numel() < numel:
            self.buffers[key] = None  # free the old buffer before the bigger one is made
            self.buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self.buffers[key][:numel]

    def reserve(self, numel: int, n: int, like: torch.Tensor) -> None:
        """Make room, now and on this thread, for a ring reduce-scatter or all-reduce of `numel`
        elements over n ranks (`receive_numel`): a caller that hands the collective to another
        thread allocates nothing there (what minipar's memory tracker watches is this thread)."""
        self.take(receive_numel(numel, n), like)

    def release(self) -> None:
        """Free the space (ZeRO-3 does, once a step, to hold no more than it must)."""
        self.buffers.clear()


def receive_numel(numel: int, n: int) -> int:
    """Elements of receive space the ring's reduce-scatter phase takes for a tensor of `numel` over
    n ranks: the n-1 partial sums a rank receives, at most (n-1) * ceil(numel / n) (the chunks of
    torch.tensor_split differ by one element at most)."""
    return (n - 1) * -(-numel // n)


def _ring(chunks: list[torch.Tensor], phases: list[str], group, kind: str, out=None, stats=None,
          scratch: Scratch | None = None, observe=None) -> None:
    """Run ring phases over `chunks` (one per rank of the group, possibly uneven), in order.

    reduce-scatter: a partial sum arrives from the left (into scratch space), this rank adds its own
                    share (`chunks` are only read) and sends the sum on at the next step; when chunk
                    `rank` arrives, the finished sum goes to `out`.
    all-gather:     finished chunks arrive in place and are sent on at the next step.

    On gloo every receive is posted before the first send (`_posts_ahead`); messages between two
    ranks match in the order they were posted, which is the schedule's order.
    observe(phase, step, chunk, value), if given, is called after each step (step from 1 in each
    phase) with the chunk index that arrived and what this rank now holds of it: a partial sum in
    reduce-scatter, the finished sum in all-gather. value is the ring's own buffer, which the next
    step sends: read it, never change or keep it.
    """
    rank, n, ranks = _group_info(group)
    right, left = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    plan = [(phase, *step[rank]) for phase in phases for step in ring_schedule(n, phase)]
    sums = [chunks[recv_i] for phase, _, recv_i in plan if phase == "reduce-scatter"]
    need = sum(c.numel() for c in sums)  # at most receive_numel
    space = scratch.take(need, chunks[0]) if scratch is not None else chunks[0].new_empty(need)
    space = iter(space.split([c.numel() for c in sums]))
    landing = [next(space).view_as(chunks[recv_i]) if phase == "reduce-scatter" else chunks[recv_i]
               for phase, _, recv_i in plan]
    ahead = _posts_ahead(group)
    recvs = [irecv(t, left, group) for t in landing] if ahead else [None] * len(plan)
    sends, ready = [], chunks[plan[0][1]]  # step 0 sends this rank's own chunk
    for i, ((phase, send_i, recv_i), incoming, recv) in enumerate(zip(plan, landing, recvs)):
        if ahead:  # ready holds chunk send_i: what arrived (and was added to) at the step before
            sends.append(isend(ready, right, group, kind, stats))
            wait(recv)
        else:
            _exchange(ready, right, incoming, left, group, kind, stats)
        if phase == "all-gather":
            ready = incoming
        else:
            ready = torch.add(incoming, chunks[recv_i], out=out if recv_i == rank else incoming)
        if observe is not None:
            observe(phase, i % (n - 1) + 1, recv_i, ready)
    wait(*sends)


# ----------------------------------------------------------------------------- collectives


def reduce_scatter(tensor: torch.Tensor, group=None, stats: CommStats | None = None,
                   scratch: Scratch | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum over the group of `tensor`, and this rank's part of it: `tensor_split(sum, n)[rank]`.
    stats: where to count what it sends; scratch: receive space to reuse (else fresh); out: where
    to write the part (else a new tensor)."""
    _record(stats, "reduce_scatter", calls=1)
    rank, n, _ = _group_info(group)
    chunks = torch.tensor_split(tensor.detach().contiguous(), n)
    out = torch.empty_like(chunks[rank]) if out is None else out
    if n == 1:
        return out.copy_(chunks[0])
    _ring(chunks, ["reduce-scatter"], group, "reduce_scatter", out, stats, scratch)
    return out


def all_gather(tensor: torch.Tensor, group=None, stats: CommStats | None = None,
               scratch: Scratch | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's `tensor` (same shape everywhere) concatenated along dim 0, in rank order, into
    `out` if given. (scratch: unused, the chunks arrive in place; taken so that the three
    collectives are alike.)"""
    _record(stats, "all_gather", calls=1)
    rank, n, _ = _group_info(group)
    # 0-dim: out is (n,)
    piece = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    if out is None:
        out = torch.empty((n * piece.shape[0], *piece.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
    chunks = out.chunk(n)
    chunks[rank].copy_(piece)
    if n > 1:
        _ring(chunks, ["all-gather"], group, "all_gather", stats=stats)
    return out


def all_reduce(tensor: torch.Tensor, group=None, stats: CommStats | None = None,
               scratch: Scratch | None = None, observe=None) -> torch.Tensor:
    """Sum `tensor` in place across the group: ring reduce-scatter, then ring all-gather.
    observe: called after each of the 2(N-1) ring steps (see `_ring`); None, the default, costs one
    `is not None` test a step."""
    _record(stats, "all_reduce", calls=1)
    rank, n, _ = _group_info(group)
    if n == 1:
        return tensor
    flat = tensor.detach().contiguous().view(-1)  # a copy only when tensor is not contiguous
    chunks = torch.tensor_split(flat, n)
    phases = ["reduce-scatter", "all-gather"]
    _ring(chunks, phases, group, "all_reduce", chunks[rank], stats, scratch, observe)
    if not tensor.is_contiguous():
        tensor.detach().copy_(flat.view_as(tensor))
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None, pieces: int = 8,
              stats: CommStats | None = None) -> torch.Tensor:
    """Copy src's `tensor` (src a global rank) to every rank, in place, along a pipelined chain.

    The chain starts at src and follows the ring; the tensor travels in `pieces` parts so that a
    rank forwards part i while it receives part i+1 (bandwidth-optimal for large tensors).
    """
    _record(stats, "broadcast", calls=1)
    rank, n, ranks = _group_info(group)
    if src not in ranks:
        raise ValueError(f"broadcast src {src} is not in the group {ranks}")
    pos = (rank - ranks.index(src)) % n  # position along the chain, src = 0
    if n == 1:
        return tensor
    flat = tensor.detach().contiguous().view(-1)  # a copy only when tensor is not contiguous
    parts = torch.tensor_split(flat, min(pieces, max(1, flat.numel())))
    right, left = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
    ahead = _posts_ahead(group)
    recvs = [irecv(part, left, group) if pos > 0 and ahead else None for part in parts]
    sends = []
    for part, recv in zip(parts, recvs):
        if pos > 0 and not ahead:
            recv = irecv(part, left, group)
        wait(recv)
        if pos < n - 1:
            sends.append(isend(part, right, group, "broadcast", stats))
    wait(*sends)
    if not tensor.is_contiguous():
        tensor.detach().copy_(flat.view_as(tensor))
    return tensor


# -------------------------------------------------------------------- the backend's, side by side


def nominal(stats: CommStats | None, kind: str, n: int, nbytes: int) -> None:
    """Count a backend collective of `nbytes` over n ranks as the ring would send it (gloo's and
    NCCL's algorithms may differ), under "torch_<kind>"."""
    _record(stats, f"torch_{kind}", (2 if kind == "all_reduce" else 1) * (n - 1) * nbytes // n, 1)


def torch_all_reduce(tensor: torch.Tensor, group=None, stats: CommStats | None = None,
                     scratch=None) -> torch.Tensor:
    """torch.distributed's all-reduce, in place, counted like ours (scratch: unused, as below)."""
    nominal(stats, "all_reduce", dist.get_world_size(group), tensor.numel() * tensor.element_size())
    dist.all_reduce(tensor, group=group)
    return tensor


def torch_reduce_scatter(tensor: torch.Tensor, group=None, stats: CommStats | None = None,
                         scratch=None, out: torch.Tensor | None = None, async_op: bool = False):
    """torch.distributed's reduce-scatter along dim 0 (its length must divide by the group size),
    into `out` if given; with async_op, (out, the backend's work to wait on)."""
    n = dist.get_world_size(group)
    if out is None:
        out = torch.empty((tensor.shape[0] // n, *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
    nominal(stats, "reduce_scatter", n, tensor.numel() * tensor.element_size())
    # torch < 2.13
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = reduce_scatter(out, tensor.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def torch_all_gather(tensor: torch.Tensor, group=None, stats: CommStats | None = None,
                     scratch=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.distributed's all-gather along dim 0 (every rank's tensor of the same shape), into
    `out` if given."""
    n = dist.get_world_size(group)
    if out is None:
        out = torch.empty((n * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
    nominal(stats, "all_gather", n, out.numel() * out.element_size())
    # torch < 2.13
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, tensor.contiguous(), group=group)
    return out


def all_to_all(x: torch.Tensor, sends: list, receives: list, group=None,
               stats: CommStats | None = None, kind: str = "all_to_all") -> torch.Tensor:
    """torch.distributed's all-to-all of rows, differentiable: x's rows (dim 0) in blocks of
    sends[r] go to rank r, and the blocks of receives[r] rows from rank r come back in rank order;
    the backward is the same exchange reversed. Counted under `kind` (rows to other ranks only)."""
    return _AllToAll.apply(x, list(sends), list(receives), group, stats, kind)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sends, receives, group, stats, kind):
        ctx.args = receives, sends, group, stats, kind
        out = x.new_empty((sum(receives), *x.shape[1:]))
        row = x[0].numel() * x.element_size() if len(x) else 0
        _record(stats, kind, (sum(sends) - sends[dist.get_rank(group)]) * row, calls=1)
        dist.all_to_all_single(out, x.contiguous(), receives, sends, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, *ctx.args), None, None, None, None, None


@dataclass(frozen=True)
class Collectives:
    """One implementation's all-reduce, reduce-scatter and all-gather: (tensor, group) -> tensor."""
    all_reduce: object
    reduce_scatter: object
    all_gather: object


IMPLEMENTATIONS = {"minipar": (all_reduce, reduce_scatter, all_gather),
                   "torch": (torch_all_reduce, torch_reduce_scatter, torch_all_gather)}


def implementation(name: str, stats: CommStats | None = None,
                   scratch: Scratch | None = None) -> Collectives:
    """The collectives of implementation `name` ("minipar": the ring above, "torch": the backend's),
    counting into `stats` and, for the ring, receiving into `scratch` (see Scratch)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"collectives must be one of {tuple(IMPLEMENTATIONS)}, got {name!r}")
    bound = (functools.partial(fn, stats=stats, scratch=scratch) for fn in IMPLEMENTATIONS[name])
    return Collectives(*bound)
