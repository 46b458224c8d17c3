"""Data parallelism: every rank holds the whole model, takes a slice of the batch, and averages the
gradients with an all-reduce before the optimizer step (PyTorch DDP: Li et al. 2020, VLDB).

Where a gradient lives, for DP and for ZeRO-1/2 alike (`GradBuckets`): as soon as autograd has a
parameter's gradient, a hook adds it into the parameter's slice of a flat *bucket* and frees it
(Megatron-LM's "main grads"). The bucket's dtype is the gradient dtype chosen: fp32 under mixed
precision, so that micro-batch gradients accumulate in fp32 and the reduction sums in fp32 (the
mixed-precision paper's rule for the sums inside each op, Micikevicius et al. 2018, sec. 3.3,
applied to the gradients as Megatron-LM does). After the reduction the
optimizer's parameters (the model's, or the fp32 masters) get views of the bucket as their .grad:
no second copy of the gradients (DDP's `gradient_as_bucket_view`).

Simplest first, two classes:
  naive        `DataParallelNaive`: a bucket per parameter; after backward, one all-reduce each;
               nothing overlaps.
  bucketed     `DataParallelBucket`: parameters fill buckets of about `bucket_bytes` in reverse
               order (the order backward produces their gradients); a bucket whose gradients are all
               in is all-reduced asynchronously while backward goes on with the earlier layers; the
               optimizer step waits for every bucket.
  accumulation inside `no_sync()` the hooks only add: with M micro-batches the gradients add up in
               the buckets and only the last micro-step communicates.
ZeRO-1 and 2 use the same buckets, reduce-scattered instead (zero.py, `GradBuckets(scatter=True)`).

The collective is minipar's ring (comm.py, run on a communication thread so it overlaps) or the
backend's (`async_op=True`). Either way the ranks launch buckets in the same order (bucket i only
after buckets < i), as collectives must be matched across ranks. Everything a collective writes
(its output, the ring's receive space) is allocated here, on the main thread, before it is handed
over: the communication thread allocates nothing (minipar's memory tracker watches one thread).

Cost per rank, for P parameters with G gradient bytes (4P in fp32 and with fp32 gradients under
mixed precision, 2P with 16-bit ones) and N ranks:
  memory         the model's states, with the gradients in the buckets (G: they are the .grad), and
                 the ring's receive space, (N-1)/N of the largest bucket (ZeRO: from a step's
                 first launch to its finish only)
  communication  2(N-1)/N * G bytes sent a step (ring), in P_tensors messages (naive) or
                 ceil(G / bucket_bytes) messages (bucketed, about); none on non-final micro-steps
  time           naive: backward + all of the all-reduce; bucketed: backward + only the last
                 bucket's all-reduce, if the ones before finished under the rest of backward
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from minipar import comm


class _Bucket:
    """A flat gradient buffer for a run of parameters, padded to a multiple of n (so that it cuts
    into n equal shards for a reduce-scatter), and what of it has arrived or is in flight."""

    def __init__(self, params: list, n: int, dtype, device):
        self.params, self.dtype, self.device = params, dtype, device
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.shard = -(-total // n)  # ceil: each of the n shards
        self.numel = self.shard * n
        self.buffer: torch.Tensor | None = None  # allocated while it holds gradients
        self.reduced: torch.Tensor | None = None  # reduce-scatter: this rank's shard of the sum
        self.arrived = 0  # gradients added in this backward
        self.stale = False  # holds the last step's gradients: zeroed by the next arrival
        self.work = self.output = None  # the collective in flight, and where it writes
        self.group, self.size, self.divisor = None, 1, 1  # reduced over, its ranks, sum / divisor

    def slice(self, i: int) -> torch.Tensor:
        return self.buffer[self.offsets[i]: self.offsets[i] + self.params[i].numel()]

    def allocate(self) -> None:
        self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)


def split(sizes: list[int], bucket_bytes: int | None, element_bytes: int) -> list[list[int]]:
    """Indices of parameters of these sizes (elements, model order) in each bucket: in the order
    backward produces their gradients (reverse), a new bucket when the next parameter would take
    this one past bucket_bytes. None: one parameter each, in model order. (memory.py predicts with
    it.)"""
    if bucket_bytes is None:
        return [[i] for i in range(len(sizes))]
    buckets, run, run_bytes = [], [], 0
    for i in reversed(range(len(sizes))):
        if run and run_bytes + sizes[i] * element_bytes > bucket_bytes:
            buckets.append(run)
            run, run_bytes = [], 0
        run.append(i)
        run_bytes += sizes[i] * element_bytes
    return buckets + [run]


def buckets_of(params: list, bucket_bytes: int | None, element_bytes: int) -> list[list]:
    """The parameters in each bucket (`split`)."""
    return [[params[i] for i in bucket]
            for bucket in split([p.numel() for p in params], bucket_bytes, element_bytes)]


class GradBuckets:
    """The gradients of `params`, accumulated in buckets of `dtype` and reduced over `group`.

    buckets: lists of parameters (`buckets_of`); overlap: launch a bucket's collective as soon as
    its gradients are in (else all of them in `finish`); scatter: reduce-scatter (ZeRO: each rank
    keeps `bucket.reduced`, its shard of the sum) instead of all-reduce; keep: the full buffers
    persist between steps and accumulate through `no_sync` (DP, ZeRO-1) — else (ZeRO-2) they live
    from their first gradient until reduced and, overlapped, every micro-batch's backward reduces
    them into the shards, at most two alive at once (the one filling and the one in flight: a
    new one waits for the older); holders: whose .grad gets the reduced gradients (DP only;
    default the parameters themselves; the fp32 masters under mixed precision). stats: the
    CommStats that counts what it sends. experts: (group, divisor) for the buckets of expert
    weights cut by expert parallelism (`.ep`): summed over that group (the ranks that hold the
    same experts) and divided by divisor (dp), not averaged over `group` (expert_parallel.py)."""

    def __init__(self, params: list, buckets: list[list], group=None, *, dtype=None,
                 overlap: bool = True, scatter: bool = False, keep: bool = True, holders=None,
                 collectives: str = "minipar", stats: comm.CommStats | None = None,
                 experts: tuple | None = None):
        if collectives not in ("minipar", "torch"):
            raise ValueError(f"collectives must be 'minipar' or 'torch', got {collectives!r}")
        self.group, self.collectives, self.stats = group, collectives, stats
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.overlap, self.scatter, self.keep = overlap, scatter, keep
        self.params = params
        self.holder = dict(zip(map(id, params), holders or params))
        device = params[0].device
        self.buckets = [_Bucket(b, self.size if scatter else 1, dtype or b[0].dtype, device)
                        for b in buckets]
        for bucket in self.buckets:
            if experts and hasattr(bucket.params[0], "ep"):
                bucket.group, bucket.divisor = experts
                bucket.size = dist.get_world_size(experts[0]) if dist.is_initialized() else 1
            else:
                bucket.group, bucket.size, bucket.divisor = group, self.size, self.size
            if keep:  # (ZeRO-1's reduced shard is the bucket's own slice, reduced in place)
                bucket.allocate()
                bucket.reduced = self._mine(bucket) if scatter else None
        self.sync, self._next, self._rounds, self._launched = True, 0, 0, []
        self.tracker = None  # a minipar.tracker.Tracker watching the step: told what it allocates
        self.spans: list[tuple[str, float, float]] = []  # (what, start, end), perf_counter s
        self.scratch = comm.Scratch()  # the ring's receive space, used on the communication thread
        self.ops = comm.implementation(collectives, stats, self.scratch)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minipar-comm") \
            if collectives == "minipar" and max(b.size for b in self.buckets) > 1 else None
        if not scatter:  # DP keeps it, as DDP keeps its buckets; ZeRO makes it at each step's
            self._reserve()  # first launch and frees it in finish, as FSDP2 frees its buffers
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(lambda p, b=b, i=i: self._arrived(b, i))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally inside the block (gradient accumulation): no communication,
        unless the buffers do not persist (ZeRO-2 reduces every micro-batch)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    # ------------------------------------------------------------------------- backward's hooks

    def _arrived(self, b: int, i: int) -> None:
        """Hook: parameter i of bucket b has its gradient: add it into the bucket, free it, and
        launch every bucket that is complete, in order."""
        bucket = self.buckets[b]
        p = bucket.params[i]
        if bucket in self._launched:  # the last micro-batch's, still in flight
            self._retire([bucket])
        if bucket.buffer is None:
            self._retire(self._launched[:-1])  # at most one bucket in flight beside this one
            self._allocate(bucket)
        piece = bucket.slice(i)
        if p.grad.data_ptr() != piece.data_ptr():  # else autograd added into the view already
            if bucket.stale:  # (a .grad left from the last step, not zeroed: PyTorch accumulates)
                bucket.buffer.zero_()
            piece.add_(p.grad.view(-1))
            p.grad = None
        bucket.stale = False
        if self.sync or not self.keep:  # (kept buffers count the micro-batch that launches them)
            bucket.arrived += 1
        if self.overlap and (self.sync or not self.keep):
            while self._next < len(self.buckets) and \
                    self.buckets[self._next].arrived == len(self.buckets[self._next].params):
                self._launch(self._next)

    def _allocate(self, bucket: _Bucket) -> None:
        bucket.allocate()
        if self.tracker:  # a Tracker watches this step: a gradient buffer is born
            self.tracker.declare("grads", bucket.buffer)

    def _reserve(self) -> None:
        """Make the ring's receive space for the largest bucket, here on the main thread, unless
        it is there: it never grows while the ring is using it."""
        if self.collectives == "minipar" and self._executor and not self.scratch.buffers:
            largest = max(self.buckets, key=lambda b: comm.receive_numel(b.numel, b.size))
            self.scratch.reserve(largest.numel, largest.size, torch.empty(0, dtype=largest.dtype))
            if self.tracker:  # a Tracker watches this step
                self.tracker.declare("comm", *self.scratch.buffers.values())

    def _launch(self, b: int) -> None:
        """Start bucket b's collective (on the communication thread for the ring). A round of
        launches ends with the last bucket; ZeRO-2's next micro-batch starts another."""
        bucket = self.buckets[b]
        self._reserve()
        self._next, self._rounds = (0, self._rounds + 1) if b + 1 == len(self.buckets) else \
            (b + 1, self._rounds)
        bucket.arrived = 0
        if bucket.buffer is None:  # no gradient arrived (ZeRO-2): zeros
            self._allocate(bucket)
        elif bucket.stale:  # none arrived since the last step
            bucket.buffer.zero_()
        what, tensor = f"bucket {b}", bucket.buffer
        # a reduce-scatter lands in place, in my shard of the bucket (NCCL's in-place layout)
        bucket.output = self._mine(bucket) if self.scatter else None
        if bucket.size == 1:
            bucket.work = None
        elif self.collectives == "torch":
            if self.scatter:
                bucket.work = comm.torch_reduce_scatter(tensor, self.group, self.stats,
                                                        out=bucket.output, async_op=True)[1]
            else:
                comm.nominal(self.stats, "all_reduce", bucket.size,
                             tensor.numel() * tensor.element_size())
                bucket.work = dist.all_reduce(tensor, group=bucket.group, async_op=True)
        else:
            bucket.work = self._executor.submit(self._timed, what, tensor, bucket.output,
                                                bucket.group)
        self._launched.append(bucket)

    def _timed(self, what: str, tensor: torch.Tensor, out, group) -> None:
        """On the communication thread: the ring collective, its span recorded."""
        start = time.perf_counter()
        if self.scatter:
            self.ops.reduce_scatter(tensor, group, out=out)
        else:
            self.ops.all_reduce(tensor, group)
        self.spans.append((what, start, time.perf_counter()))

    def _mine(self, bucket: _Bucket) -> torch.Tensor:
        """My shard of the bucket's buffer: where its reduce-scatter leaves my part of the sum."""
        return bucket.buffer[self.rank * bucket.shard: (self.rank + 1) * bucket.shard]

    def _retire(self, buckets: list) -> None:
        """Wait for these buckets' collectives. Unless the buffers persist (ZeRO-1's reduced
        shard is its bucket's slice), a reduce-scatter's shard is copied out as the step's
        `reduced` (its first micro-batch) or added to it, and the full buffer freed."""
        for bucket in buckets:
            if bucket.work is not None:
                bucket.work.wait() if hasattr(bucket.work, "wait") else bucket.work.result()
            if self.scatter and not self.keep and bucket.reduced is None:
                bucket.reduced = bucket.output.clone()
                if self.tracker:  # a Tracker watches this step: a gradient shard is born
                    self.tracker.declare("grads", bucket.reduced)
            elif self.scatter and not self.keep:
                bucket.reduced.add_(bucket.output)
            bucket.work = bucket.output = None
            if not self.keep:
                bucket.buffer = None
            self._launched.remove(bucket)

    # ------------------------------------------------------------------------- after backward

    def finish(self) -> None:
        """Launch what backward did not (gradients never produced count as zeros; a pipeline's
        whole step runs in no_sync), wait for every bucket, and average: the holders' .grad (DP)
        or each bucket's `reduced` shard (ZeRO) is the mean over the group."""
        start = time.perf_counter()
        if self._next or not self._rounds:  # a round begun, or none this step
            for b in range(self._next, len(self.buckets)):
                self._launch(b)
        self._retire(list(self._launched))
        if self.scatter:
            self.scratch.release()
        for bucket in self.buckets:
            if self.scatter:
                bucket.reduced.div_(self.size)
            else:
                bucket.buffer.div_(bucket.divisor)
                for i, p in enumerate(bucket.params):
                    self.holder[id(p)].grad = bucket.slice(i).view_as(p)
            bucket.stale = True
        self._next = self._rounds = 0
        self.spans.append(("wait", start, time.perf_counter()))

    def zero_grad(self) -> None:
        """Free ZeRO-2's reduced shards (made again by the next step's first reduction, as FSDP2
        frees its sharded gradients); the buffers are zeroed by their next gradient."""
        for bucket in self.buckets:
            if not self.keep:
                bucket.reduced = None
            bucket.stale = True

    def grad(self, p) -> torch.Tensor | None:
        """The gradient the optimizer sees for parameter p (its holder's, after finish)."""
        return self.holder[id(p)].grad

    def buffers(self) -> list[torch.Tensor]:
        """The full gradient buffers allocated now."""
        return [b.buffer for b in self.buckets if b.buffer is not None]

    @property
    def comm_buffer_bytes(self) -> int:
        """Bytes of the ring's receive space (the buckets themselves are the gradients)."""
        return sum(t.numel() * t.element_size() for t in self.scratch.buffers.values())

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()


class DataParallelNaive(GradBuckets):
    """Averages the gradients of `model` over `group` (N ranks) after backward, one all-reduce per
    parameter: call `finish()` before `optimizer.step()`. Nothing overlaps; the simplest correct DP.

    collectives: "minipar" (ring, on a communication thread) or "torch" (the backend's all-reduce);
    dtype: the gradients' (default the parameters'; fp32 under mixed precision); holders: whose
    .grad the averages become (default the parameters; the fp32 masters); stats: the CommStats
    that counts what it sends (None: not counted).
    """

    def __init__(self, model: torch.nn.Module, group=None, collectives: str = "minipar",
                 stats: comm.CommStats | None = None, dtype=None, holders=None,
                 experts: tuple | None = None):
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, _apart(params, None, 0), group, dtype=dtype, overlap=False,
                         holders=holders, collectives=collectives, stats=stats, experts=experts)


class DataParallelBucket(GradBuckets):
    """DataParallelNaive, bucketed and overlapped with backward (PyTorch DDP's design): a full
    bucket of about `bucket_bytes` is all-reduced while backward goes on. `finish()` waits for the
    buckets; the .grad are views of them."""

    def __init__(self, model: torch.nn.Module, group=None, bucket_bytes: int = 25 * 2**20,
                 collectives: str = "minipar", stats: comm.CommStats | None = None, dtype=None,
                 holders=None, experts: tuple | None = None):
        params = [p for p in model.parameters() if p.requires_grad]
        element = torch.empty(0, dtype=dtype or params[0].dtype).element_size()
        super().__init__(params, _apart(params, bucket_bytes, element), group, dtype=dtype,
                         holders=holders, collectives=collectives, stats=stats, experts=experts)


def _apart(params: list, bucket_bytes: int | None, element_bytes: int) -> list[list]:
    """buckets_of, the experts cut by expert parallelism in buckets of their own, after the rest
    (they reduce over another group; launched last, they overlap less)."""
    dense = [p for p in params if not hasattr(p, "ep")]
    experts = [p for p in params if hasattr(p, "ep")]
    return buckets_of(dense, bucket_bytes, element_bytes) + \
        (buckets_of(experts, bucket_bytes, element_bytes) if experts else [])
