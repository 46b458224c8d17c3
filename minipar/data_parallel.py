"""Data parallelism: every rank holds the whole model, takes a slice of the batch, and averages the
gradients with an all-reduce before the optimizer step (PyTorch DDP: Li et al. 2020, VLDB).

Simplest first, two classes:
  naive        `DataParallelNaive`: after backward, one all-reduce per parameter; nothing overlaps.
  bucketed     `DataParallelBucket`: a hook on each parameter copies its gradient, as soon as
               autograd has accumulated it, into a fixed-size bucket (parameters fill buckets in
               reverse order, the order backward produces their gradients). A full bucket is
               all-reduced asynchronously while backward goes on with the earlier layers; the
               optimizer step waits for every bucket.
  accumulation inside `no_sync()` the hooks do nothing: with M
  micro-batches, gradients add up locally
               and only the last micro-step communicates.

The all-reduce is minipar's ring (`comm.all_reduce`, run on a communication thread so it overlaps)
or the backend's (`dist.all_reduce(async_op=True)`). Either way the ranks launch buckets in the same
order (bucket i only after buckets < i), as collectives must be matched across ranks.

Cost per rank, for P parameters with G = 4P gradient bytes (fp32) and N ranks:
  memory         the whole model: 4P params + 4P grads + 8P Adam moments, + G of buckets (bucketed)
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
    """A flat gradient buffer for a run of parameters, and how many
    of their gradients have arrived."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.arrived: set[int] = set()
        self.work = None  # the pending all-reduce

    def slice(self, i: int) -> torch.Tensor:
        return self.buffer[self.offsets[i]: self.offsets[i] + self.params[i].numel()]


class DataParallelNaive:
    """Averages the gradients of `model` over `group` (N ranks) after backward, one all-reduce per
    parameter: call `finish()` before `optimizer.step()`. Nothing overlaps; the simplest correct DP.

    collectives: "minipar" (ring, on a communication thread) or "torch" (the backend's all-reduce);
    stats: the CommStats that counts what it sends (None: not counted).
    """

    def __init__(self, model: torch.nn.Module, group=None, collectives: str = "minipar",
                 stats: comm.CommStats | None = None):
        if collectives not in ("minipar", "torch"):
            raise ValueError(f"collectives must be 'minipar' or 'torch', got {collectives!r}")
        self.group, self.collectives, self.stats = group, collectives, stats
        self.size = dist.get_world_size(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sync = True
        self.spans: list[tuple[str, float, float]] = []  # (what, start, end), perf_counter s
        self.scratch = comm.Scratch()  # the ring's receive space, used on the communication thread
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minipar-comm") \
            if collectives == "minipar" else None

    def finish(self) -> None:
        """Make every .grad the average over the group."""
        start = time.perf_counter()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.reduce([p.grad for p in self.params])
        self.spans.append(("wait", start, time.perf_counter()))

    def reduce(self, grads: list[torch.Tensor]) -> None:
        """Average each tensor of `grads` over the group, in place, one all-reduce each (mixed
        precision hands its fp32 master gradients here: `mp.step(optimizer, reduce=dp.reduce)`)."""
        for g in grads:
            self._wait(self._all_reduce(g, "all-reduce"))
            g.div_(self.size)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally inside the block: no communication
        (gradient accumulation)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    @property
    def comm_buffer_bytes(self) -> int:
        """Bytes of communication buffers this holds: none (it reduces the gradients in place)."""
        return 0

    # ------------------------------------------------------------------------- the all-reduce

    def _all_reduce(self, tensor: torch.Tensor, what: str):
        """Start summing `tensor` over the group; returns something `_wait` can wait for."""
        if self.collectives == "torch":  # counted as a ring would send it
            nbytes = tensor.numel() * tensor.element_size()
            comm.nominal(self.stats, "all_reduce", self.size, nbytes)
            return dist.all_reduce(tensor, group=self.group, async_op=True)

        def timed():
            start = time.perf_counter()
            comm.all_reduce(tensor, self.group, self.stats, self.scratch)
            self.spans.append((what, start, time.perf_counter()))
        return self._executor.submit(timed)

    @staticmethod
    def _wait(work) -> None:
        work.wait() if hasattr(work, "wait") else work.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()


class DataParallelBucket(DataParallelNaive):
    """DataParallelNaive, bucketed and overlapped with backward (PyTorch DDP's design): a hook on
    each parameter copies its gradient into a bucket of about `bucket_bytes`, and a full bucket's
    all-reduce starts while backward goes on. `finish()` waits for the
    buckets and writes the averages back."""

    def __init__(self, model: torch.nn.Module, group=None, bucket_bytes: int = 25 * 2**20,
                 collectives: str = "minipar", stats: comm.CommStats | None = None):
        super().__init__(model, group, collectives, stats)
        self.buckets: list[_Bucket] = []
        run, run_bytes = [], 0
        for p in reversed(self.params):  # backward produces the last layers' gradients first
            if run and run_bytes + p.numel() * p.element_size() > bucket_bytes:
                self.buckets.append(_Bucket(run))
                run, run_bytes = [], 0
            run.append(p)
            run_bytes += p.numel() * p.element_size()
        self.buckets.append(_Bucket(run))
        self._next = 0  # the next bucket to launch
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(lambda p, b=b, i=i: self._grad_ready(b, i))

    def _grad_ready(self, b: int, i: int) -> None:
        """Hook: parameter i of bucket b has its gradient; launch every
        bucket that is full, in order."""
        if not self.sync:
            return
        bucket = self.buckets[b]
        bucket.slice(i).copy_(bucket.params[i].grad.view(-1))
        bucket.arrived.add(i)
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].arrived) == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def finish(self) -> None:
        """Make every .grad the average over the group (waits for the buckets in flight)."""
        start = time.perf_counter()
        # gradients no hook sent (no_sync throughout, as a pipeline step runs; or unused): as they
        # are, or zeros
        for bucket in self.buckets[self._next:]:
            for i, p in enumerate(bucket.params):
                if i not in bucket.arrived:
                    piece = bucket.slice(i)
                    piece.copy_(p.grad.view(-1)) if p.grad is not None else piece.zero_()
            self._launch(bucket)
        for bucket in self.buckets:
            self._wait(bucket.work)
            bucket.buffer.div_(self.size)
            for i, p in enumerate(bucket.params):
                p.grad = bucket.slice(i).view_as(p).clone() if p.grad is None else \
                    p.grad.copy_(bucket.slice(i).view_as(p))
            bucket.arrived.clear()
        self._next = 0
        self.spans.append(("wait", start, time.perf_counter()))

    @property
    def comm_buffer_bytes(self) -> int:
        """Bytes of the buckets: a flat copy of every gradient."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.work = self._all_reduce(bucket.buffer, f"bucket {self.buckets.index(bucket)}")
