"""ZeRO stage 3: parameters sharded too (Rajbhandari et al. 2020; PyTorch's FSDP: Zhao et al. 2023).

One flat buffer per unit (a block, an embedding, the head: FSDP's FlatParameter), of which a rank
keeps only its shard (zero.py's layout). A unit's parameters are all-gathered just before its
forward (the next unit's gather is prefetched meanwhile) and freed after it; gathered again when
backward reaches the unit (prefetching the unit before it); and once its gradients are complete
they are reduce-scattered into the rank's gradient shard (in fp32 under mixed precision by
default, where every micro-batch's shard adds up) and the unit freed. What a collective writes is
allocated on the main thread before it is handed to the communication thread.

Cost per rank, for P parameters in fp32, N ranks:
  memory    4P/N params + 4P/N grads + 8P/N optimizer, + two gathered units at most (three
            with interleaved pipeline chunks: memory.zero3_gathered) (+ up to N-1 padding
            elements per unit)
  traffic   all-gather in forward + all-gather in backward + reduce-scatter: 3 Psi (1.5x DP's),
            per micro-batch (with gradient accumulation it gathers again for each)
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from minipar import comm
from minipar.zero import (Flat, Shard, clip_coefficient, gather_shards, group_size_rank,
                          overflowed, reduce_shard)


class _Unit:
    """One module's parameters, sharded (stage 3): the shard is all this rank keeps between uses.

    The parameters stay views of one full buffer; freeing it releases the buffer's *storage*
    (resize to 0 bytes) and gathering refills it. Pointing the parameters at empty tensors instead
    would free nothing: autograd has saved views of the weights (W.t() of each Linear) for backward,
    and those would keep the gathered buffer alive. This is how PyTorch's FSDP frees, too."""

    def __init__(self, module: torch.nn.Module, n: int, rank: int, dtype, master: bool, lr,
                 weight_decay, betas, grad_dtype):
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.layout = Flat(self.params, n, rank)
        fp32 = self.layout.flatten(self.params)[self.layout.lo: self.layout.hi]
        self.grad_dtype = grad_dtype
        self.mine = Shard(self.layout, fp32.to(dtype, copy=True), fp32.clone() if master else None,
                          lr, weight_decay, betas, grads=fp32.new_zeros(0, dtype=grad_dtype))
        self.full = self.mine.params.new_empty(self.mine.params.numel() * n)
        self.layout.point_params_at(self.full)
        self.gathering, self.gathered = None, True  # the future of an all-gather in flight
        # parameters whose gradient has arrived in this backward
        self.grads_in = 0
        self.free()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def refill(self) -> None:
        """Give the full buffer its storage back (on the main thread: the gather fills it)."""
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())


class Zero3:
    """ZeRO stage 3 over `group`: shards `model` in place; call `step()` after backward.
    dtype, master, grad_dtype, scaler, stats, and step's clip: as ZeroOptimizer's."""

    def __init__(self, model: torch.nn.Module, group=None, lr: float = 1e-3,
                 weight_decay: float = 0.0, betas=(0.9, 0.95), collectives: str = "minipar",
                 dtype=torch.float32, master: bool = False, scaler=None,
                 stats: comm.CommStats | None = None, grad_dtype=None):
        self.group, self.collectives, self.scaler, self.stats = group, collectives, scaler, stats
        self.scratch = comm.Scratch()  # the ring's receive space, used on the communication thread
        self.ops = comm.implementation(collectives, stats, self.scratch)
        self.size, rank = group_size_rank(group)
        # units in forward order: the model's children, a ModuleList counting as its members
        modules = [m for child in model.children()
                   for m in (child if isinstance(child, torch.nn.ModuleList) else [child])]
        self.units = [_Unit(m, self.size, rank, dtype, master, lr, weight_decay, betas,
                            grad_dtype or dtype)
                      for m in modules if any(p.requires_grad for p in m.parameters())]
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self._comm = ThreadPoolExecutor(1, thread_name_prefix="minipar-zero3")
        self.tracker = None  # a minipar.tracker.Tracker watching the step: told what it allocates
        self.pending = []  # reductions in flight: (work, the unit's full gradients, the landing)
        for i, unit in enumerate(self.units):
            unit.module.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
            unit.module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_arrived(i))

    # ------------------------------------------------------------------------- gather and free

    def _start_gather(self, i: int) -> None:
        unit = self.units[i]
        if not unit.gathered and unit.gathering is None:
            unit.refill()
            unit.gathering = self._comm.submit(gather_shards, unit.mine.params, self.group,
                                               self.ops, unit.full)
            self.gathered_bytes += unit.full.numel() * unit.full.element_size()
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _gather(self, i: int) -> None:
        """Wait for unit i's parameters (start the all-gather if no prefetch did)."""
        unit = self.units[i]
        if unit.gathered:
            return
        self._start_gather(i)
        unit.gathering.result()
        unit.gathering, unit.gathered = None, True

    def _free(self, i: int) -> None:
        unit = self.units[i]
        if unit.gathered:
            self.gathered_bytes -= unit.full.numel() * unit.full.element_size()
            unit.free()

    def _before_forward(self, i: int) -> None:
        self._gather(i)
        if i + 1 < len(self.units):
            self._start_gather(i + 1)  # prefetch: the next unit's all-gather overlaps this forward

    def _after_forward(self, i: int, out) -> None:
        self._free(i)
        if isinstance(out, torch.Tensor) and out.requires_grad:  # backward reaches this unit here
            out.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._gather(i)
        if i > 0:
            self._start_gather(i - 1)  # prefetch: backward goes on to the unit before

    def _grad_arrived(self, i: int) -> None:
        """All of unit i's gradients are in: start reducing them into my shard, free the unit."""
        unit = self.units[i]
        unit.grads_in += 1
        if unit.grads_in < len(unit.params):
            return
        unit.grads_in = 0
        grads = unit.layout.flatten((p.grad for p in unit.params), unit.grad_dtype)
        for p in unit.params:
            p.grad = None
        # on the communication thread, after any gather queued before it: every collective of a
        # rank must run in one order, the same on all ranks; what it writes is allocated here
        out = torch.empty(unit.mine.params.numel(), dtype=unit.grad_dtype, device=grads.device)
        if not self.scratch.buffers and self.collectives == "minipar":  # the step's first: none
            # in flight (the backend's collectives need no receive space of ours)
            self.scratch.reserve(max(u.full.numel() for u in self.units), self.size, grads)
            if self.tracker:  # a Tracker watches this step
                self.tracker.declare("comm", *self.scratch.buffers.values())
        if self.tracker:  # a Tracker watches this step
            self.tracker.declare("grads", grads)
            self.tracker.declare("comm", out)
        if not unit.mine.grads.numel():  # the step's first: between steps a rank holds none
            unit.mine.grads = torch.zeros_like(out)
            if self.tracker:
                self.tracker.declare("grads", unit.mine.grads)
        # at most one reduction in flight beside this one, its buffers freed here when it is done
        # (not whenever the communication thread finishes): what a rank holds is deterministic
        self._retire(self.pending[:-1])
        self.pending.append((self._comm.submit(_reduce_into, unit.mine.grads, grads, self.group,
                                                self.ops, out), grads, out))
        self._free(i)

    def _retire(self, pending: list) -> None:
        for entry in pending:
            entry[0].result()
            self.pending.remove(entry)

    # ------------------------------------------------------------------------- optimizer interface

    def step(self, clip=None, sp=None) -> None:
        """Wait for the reduced gradient shards and update them (sp: unused, ZeRO-3 refuses SP)."""
        self._retire(list(self.pending))  # every micro-batch's reduced shards are added in
        for unit in self.units:
            if not unit.mine.grads.numel():  # no gradient reached it
                unit.mine.grads = torch.zeros_like(unit.mine.params, dtype=unit.grad_dtype)
            unit.mine.grads.div_(self.size)
        self._comm.submit(self.scratch.release).result()  # free it, until the next backward
        scale = self.scaler.scale if self.scaler else 1.0
        overflow = overflowed([u.mine for u in self.units], self.scaler, self.group, self.stats)
        coefficient = clip_coefficient(clip, [u.mine for u in self.units], scale, self.group)
        if overflow:
            return
        for unit in self.units:
            unit.mine.update(scale, coefficient)

    def zero_grad(self) -> None:
        """Drop the gradient shards: between steps a rank keeps no gradients at all."""
        for unit in self.units:
            unit.mine.grads = unit.mine.params.new_zeros(0)

    @property
    def param_groups(self) -> list[dict]:  # every unit's shard optimizer's
        return [group for unit in self.units for group in unit.mine.optimizer.param_groups]

    def gather_all(self) -> None:
        """Gather every unit (a collective), to read the full weights; the next forward frees."""
        for i in range(len(self.units)):
            self._gather(i)

    def state_tensors(self):
        for unit in self.units:
            yield from unit.mine.state_tensors()

    def grad_tensors(self):
        return [u.mine.grads for u in self.units]

    def comm_tensors(self):
        """The units' full buffers (empty but while gathered) and the ring's receive space."""
        return [u.full for u in self.units] + list(self.scratch.buffers.values())

    def param_tensors(self):
        return [u.mine.params for u in self.units]

    @property
    def comm_bytes(self) -> int:
        """The gathered parameters at their peak (memory.zero3_gathered predicts it)."""
        return self.peak_gathered_bytes

    def close(self) -> None:
        self._comm.shutdown()


def unit_events(spans: dict, op: str, chunk: int, gathered: set):
    """Zero3's gathers and frees in one pipeline action, as its hooks run them (what the memory
    predictions walk: memory.zero3_gathered, step_memory). spans: {chunk: range of its units'
    indices} of a rank, its units numbered in forward order; op "F" or "B" of `chunk`; gathered:
    the units gathered now, updated in place (a prefetch may outlive the action). Yields ("gather",
    i) as unit i is gathered, before its forward (backward) or prefetched, the next unit in forward
    (the one before in backward) whichever chunk it is in; then (op, i) as its forward ends (its
    gradients are in), before it is freed."""
    units, step = sum(len(r) for r in spans.values()), 1 if op == "F" else -1
    for i in spans[chunk][::step]:
        for j in (i, i + step):
            if 0 <= j < units and j not in gathered:
                gathered.add(j)
                yield "gather", j
        yield op, i
        gathered.discard(i)


def _reduce_into(shard: torch.Tensor, grads: torch.Tensor, group, ops, out: torch.Tensor) -> None:
    """On the communication thread: reduce-scatter `grads` into `out` and add it to `shard` (both
    allocated by the caller); `out` and `grads` are freed as the job ends."""
    shard.add_(reduce_shard(grads, group, ops, out))
