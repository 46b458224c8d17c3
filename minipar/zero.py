"""ZeRO: shard what data parallelism replicates (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models").

Parameters are laid out in a flat buffer, padded to a multiple of the N data-parallel ranks and cut
into N equal shards; rank r owns shard r:

    flat = [ shard 0 | shard 1 | ... | shard N-1 ]      (parameters are views into it)
             rank 0    rank 1          rank N-1

  stage 1  optimizer state sharded: after backward the gradients are reduce-scattered (rank r gets
           the sum of shard r only: the first half of an all-reduce), rank r runs AdamW on its
           shard, and the updated shards are all-gathered back into every rank's flat buffer.
  stage 2  + gradients sharded: the same collectives, but each rank keeps only its gradient shard
           (here the full gradient lives from backward until the reduce-scatter, then is freed).
  stage 3  + parameters sharded: one flat buffer per unit (a block, an embedding, the head: FSDP's
           FlatParameter), of which a rank keeps only its shard. A unit's parameters are
           all-gathered just before its forward (the next unit's gather is prefetched meanwhile) and
           freed after it; gathered again when backward reaches the unit (prefetching the unit
           before it); and once its gradients are complete they are reduce-scattered into the rank's
           gradient shard and freed too.

The optimizer is PyTorch's AdamW, run on per-parameter pieces of the shard (Parameters that alias
the shard), so each element gets exactly the update the single-process run gives it.
Mixed precision (bf16, fp16): parameters and gradients live and travel in 16 bits; each rank keeps
an fp32 master copy of its shard only, which AdamW updates and which is rounded back into the 16-bit
shard before the all-gather. That is the ZeRO paper's accounting: 2 + 2 + K bytes a parameter,
K = 12. In fp16 the gradients are unscaled in fp32, and since each rank sees only its shard, an
overflow flag is all-reduced (one float) so that all ranks skip the step together; clipping by the
global norm likewise adds up each rank's sum of squares over its shard (clip.py).

Cost per rank, for P parameters in fp32 (8 bytes of Adam moments per parameter), N ranks (in bf16:
2P params, 2P grads, 12P optimizer, sharded the same way, and half the traffic):
  memory    stage 0 (DP)  4P params + 4P grads + 8P optimizer
            stage 1       4P params + 4P grads + 8P/N optimizer
            stage 2       4P params + 4P/N grads + 8P/N optimizer
            stage 3       4P/N params + 4P/N grads + 8P/N optimizer, + two gathered units at most
            (+ up to N-1 padding elements per flat buffer)
  traffic   stages 1, 2: reduce-scatter + all-gather, (N-1)/N * 4P bytes each: 2 Psi, as in DP
            stage 3: all-gather in forward + all-gather in backward + reduce-scatter: 3 Psi (1.5x),
                     per micro-batch (with gradient accumulation it gathers again for each)
"""
from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from minipar import comm


class _Flat:
    """The layout of some parameters in a flat buffer padded to n equal shards; rank owns one."""

    def __init__(self, params: list, n: int, rank: int):
        self.params, self.n = params, n
        self.shapes = [p.shape for p in params]  # kept: a freed parameter is empty
        ends = list(itertools.accumulate(p.numel() for p in params))
        self.ranges, self.total = list(zip([0, *ends], ends)), ends[-1]
        self.shard_size = -(-self.total // n)  # ceil
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        """One padded flat tensor from per-parameter tensors (None counts as zeros)."""
        p0 = self.params[0]
        flat = torch.zeros(self.shard_size * self.n, dtype=dtype or p0.dtype, device=p0.device)
        for t, (start, end) in zip(tensors, self.ranges):
            if t is not None:
                flat[start:end].copy_(t.detach().reshape(-1))
        return flat

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into `flat` (a full, gathered buffer)."""
        for p, shape, (start, end) in zip(self.params, self.shapes, self.ranges):
            p.data = flat[start:end].view(shape)

    def adamw(self, shard: torch.Tensor, lr, weight_decay, betas):
        """PyTorch's AdamW over the pieces of the parameters that fall in my shard, the pieces, and
        the parameter each is cut from (its tp_dim says how clipping counts it).

        Each piece is a Parameter aliasing `shard` (the fp32 master shard in mixed precision), with
        its (start, end) in the shard. Weight decay goes to the pieces of matrices only, as in the
        single-process optimizer."""
        decay, no_decay, pieces, owners = [], [], [], []
        for param, shape, (start, end) in zip(self.params, self.shapes, self.ranges):
            a, b = max(start, self.lo), min(end, self.hi)
            if a < b:
                piece = torch.nn.Parameter(shard[a - self.lo: b - self.lo])
                pieces.append((piece, a - self.lo, b - self.lo))
                owners.append(param)
                (decay if len(shape) >= 2 else no_decay).append(piece)
        optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=weight_decay),
                                       dict(params=no_decay, weight_decay=0.0)], lr=lr, betas=betas)
        return optimizer, pieces, owners


class _Shard:
    """What a rank keeps of one flat buffer: its shard of the parameters (in the compute dtype), of
    the gradients (same dtype: reduce-scattered in 16 bits under mixed precision, as in the ZeRO
    paper), the fp32 master copy of its parameter shard (mixed precision only) and AdamW on it."""

    def __init__(self, layout: _Flat, params: torch.Tensor, master: torch.Tensor | None, lr,
                 weight_decay, betas):
        self.params, self.master = params, master
        self.grads = torch.zeros_like(self.params)
        updated = self.params if master is None else master
        self.optimizer, self.pieces, self.owners = layout.adamw(updated, lr, weight_decay, betas)

    def update(self, loss_scale: float = 1.0, coefficient: float = 1.0) -> None:
        """AdamW on the shard (with fp32 gradients when there are masters), on the gradients
        unscaled and times `coefficient` (clipping's), then round into params."""
        grads = self.grads.float() if self.master is not None else self.grads  # transient fp32 copy
        if loss_scale != 1.0 or coefficient != 1.0:  # a power of 2 divides exactly
            grads = grads * (coefficient / loss_scale)
        for piece, a, b in self.pieces:
            piece.grad = grads[a:b]
        self.optimizer.step()
        for piece, _, _ in self.pieces:
            piece.grad = None
        if self.master is not None:
            self.params.copy_(self.master)

    def state_tensors(self):
        if self.master is not None:
            yield self.master
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _overflowed(shards: list, scaler, group, stats: comm.CommStats | None) -> bool:
    """fp16: whether any rank's gradient shard holds an inf or nan (then every rank skips the step),
    and the loss scaler told. Without a scaler (fp32, bf16) never."""
    if scaler is None:
        return False
    flag = (~torch.stack([torch.isfinite(s.grads).all() for s in shards]).all()).float().reshape(1)
    if _group_size_rank(group)[0] > 1:  # one float: the ranks must agree, each sees only its shard
        if stats is not None:
            stats.record("overflow_flag", 4, 1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    scaler.update(bool(flag.item()))
    return bool(flag.item())


def _clip(clip, shards: list, scale: float, group) -> float:
    """Clipping's coefficient (1.0 without clip), over the pieces of all the group's shards."""
    owned = [(s.grads[a:b], p) for s in shards for (_, a, b), p in zip(s.pieces, s.owners)]
    return clip.coefficient(owned, shards[0].params.device, scale, also=(group,)) if clip else 1.0


def _group_size_rank(group) -> tuple[int, int]:
    """(N, rank) of the group; one process with no group is a group of one."""
    return (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)


def _reduce_scatter(tensor: torch.Tensor, group, ops: comm.Collectives) -> torch.Tensor:
    """My shard of the sum of `tensor` over the group (its length divides by the group size)."""
    n, _ = _group_size_rank(group)
    return tensor if n == 1 else ops.reduce_scatter(tensor, group)


def _all_gather(shard: torch.Tensor, group, ops: comm.Collectives) -> torch.Tensor:
    """Every rank's shard, concatenated in rank order."""
    n, _ = _group_size_rank(group)
    return shard if n == 1 else ops.all_gather(shard, group)


class ZeroOptimizer:
    """AdamW with ZeRO stage 1 or 2 over `group`: call `step()` after backward (it syncs too).

    dtype, master: the parameters' dtype, and whether to keep fp32 master shards (mixed precision);
    scaler: fp16's LossScaler, whose scale multiplied the loss (None otherwise); stats: the
    CommStats that counts what it sends (None: not counted)."""

    def __init__(self, model: torch.nn.Module, group=None, stage: int = 1, lr: float = 1e-3,
                 weight_decay: float = 0.0, betas=(0.9, 0.95), collectives: str = "minipar",
                 dtype=torch.float32, master: bool = False, scaler=None,
                 stats: comm.CommStats | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles stages 1 and 2, got {stage!r}")
        self.group, self.stage, self.collectives = group, stage, collectives
        self.scaler, self.stats = scaler, stats
        self.ops = comm.implementation(collectives, stats, comm.Scratch())
        self.size, rank = _group_size_rank(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layout = _Flat(self.params, self.size, rank)
        fp32 = self.layout.flatten(self.params)  # the fp32 initialisation, before any cast
        lo, hi = self.layout.lo, self.layout.hi
        self.flat = fp32.to(dtype)
        self.layout.point_params_at(self.flat)
        self.mine = _Shard(self.layout, self.flat[lo:hi], fp32[lo:hi].clone() if master else None,
                           lr, weight_decay, betas)

    def step(self, clip=None) -> None:
        """Average the gradients into my shard, update my shard, all-gather the parameters.
        clip: a ClipGradNorm, to scale the gradients by the global norm (its `norm`) first."""
        grads = self.layout.flatten(p.grad for p in self.params)
        if self.stage == 2:  # keep only the shard: the full gradient goes as soon as it is reduced
            for p in self.params:
                p.grad = None
        self.mine.grads.copy_(_reduce_scatter(grads, self.group, self.ops)).div_(self.size)
        del grads
        scale = self.scaler.scale if self.scaler else 1.0  # read before an overflow backs it off
        overflow = _overflowed([self.mine], self.scaler, self.group, self.stats)
        coefficient = _clip(clip, [self.mine], scale, self.group)
        if overflow:
            return  # fp16 overflow: nothing changed, nothing to gather
        self.mine.update(scale, coefficient)
        self.flat.copy_(_all_gather(self.mine.params, self.group, self.ops))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.mine.grads.zero_()

    @property
    def param_groups(self) -> list[dict]:  # a torch optimizer's: where the learning rate is set
        return self.mine.optimizer.param_groups

    def state_tensors(self):
        """The optimizer state this rank holds: its shard's master, moments and step counts."""
        return self.mine.state_tensors()

    def grad_tensors(self):
        """The gradients this rank keeps: all of them in stage 1 (where the reduced shard is the
        reduce-scatter's output: a comm buffer), its shard in stage 2."""
        if self.stage == 1:
            return [p.grad for p in self.params if p.grad is not None]
        return [self.mine.grads]

    def param_tensors(self):
        return self.params  # views of the flat buffer: it is counted once, padding included

    @property
    def comm_bytes(self) -> int:
        """Stage 1: the reduce-scatter's output shard (stage 2 counts it as the gradients)."""
        return self.mine.grads.numel() * self.mine.grads.element_size() if self.stage == 1 else 0


class _Unit:
    """One module's parameters, sharded (stage 3): the shard is all this rank keeps between uses.

    The parameters stay views of one full buffer; freeing it releases the buffer's *storage*
    (resize to 0 bytes) and gathering refills it. Pointing the parameters at empty tensors instead
    would free nothing: autograd has saved views of the weights (W.t() of each Linear) for backward,
    and those would keep the gathered buffer alive. This is how PyTorch's FSDP frees, too."""

    def __init__(self, module: torch.nn.Module, n: int, rank: int, dtype, master: bool, lr,
                 weight_decay, betas):
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.layout = _Flat(self.params, n, rank)
        fp32 = self.layout.flatten(self.params)[self.layout.lo: self.layout.hi]
        self.mine = _Shard(self.layout, fp32.to(dtype, copy=True), fp32.clone() if master else None,
                           lr, weight_decay, betas)
        self.full = self.mine.params.new_empty(self.mine.params.numel() * n)
        self.layout.point_params_at(self.full)
        self.gathering, self.gathered = None, True  # the future of an all-gather in flight
        # parameters whose gradient has arrived in this backward; their reduce-scatters in flight
        self.grads_in, self.reducing = 0, []
        self.free()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def gather(self, group, ops: comm.Collectives) -> None:
        """Refill the full buffer with every rank's shard (runs on the communication thread)."""
        gathered = _all_gather(self.mine.params, group, ops)
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.full.copy_(gathered)


class Zero3:
    """ZeRO stage 3 over `group`: shards `model` in place; call `step()` after backward.
    dtype, master, scaler, stats, and step's clip: as ZeroOptimizer's."""

    def __init__(self, model: torch.nn.Module, group=None, lr: float = 1e-3,
                 weight_decay: float = 0.0, betas=(0.9, 0.95), collectives: str = "minipar",
                 dtype=torch.float32, master: bool = False, scaler=None,
                 stats: comm.CommStats | None = None):
        self.group, self.collectives, self.scaler, self.stats = group, collectives, scaler, stats
        self.scratch = comm.Scratch()  # the ring's receive space, used on the communication thread
        self.ops = comm.implementation(collectives, stats, self.scratch)
        self.size, rank = _group_size_rank(group)
        # units in forward order: the model's children, a ModuleList counting as its members
        modules = [m for child in model.children()
                   for m in (child if isinstance(child, torch.nn.ModuleList) else [child])]
        self.units = [_Unit(m, self.size, rank, dtype, master, lr, weight_decay, betas)
                      for m in modules if any(p.requires_grad for p in m.parameters())]
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self._comm = ThreadPoolExecutor(1, thread_name_prefix="minipar-zero3")
        for i, unit in enumerate(self.units):
            unit.module.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
            unit.module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_arrived(i))

    # ------------------------------------------------------------------------- gather and free

    def _start_gather(self, i: int) -> None:
        unit = self.units[i]
        if not unit.gathered and unit.gathering is None:
            unit.gathering = self._comm.submit(unit.gather, self.group, self.ops)
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
        grads = unit.layout.flatten(p.grad for p in unit.params)
        for p in unit.params:
            p.grad = None
        # on the communication thread, after any gather queued before it: every collective of a
        # rank must run in one order, the same on all ranks
        unit.reducing.append(self._comm.submit(_reduce_scatter, grads, self.group, self.ops))
        self._free(i)

    # ------------------------------------------------------------------------- optimizer interface

    def step(self, clip=None) -> None:
        for unit in self.units:
            reduced = [r.result() for r in unit.reducing]  # one per micro-batch
            unit.reducing.clear()
            grads = sum(reduced[1:], reduced[0]) if reduced else torch.zeros_like(unit.mine.params)
            unit.mine.grads = grads.div_(self.size)
        self._comm.submit(self.scratch.release).result()  # free it, until the next backward
        scale = self.scaler.scale if self.scaler else 1.0
        overflow = _overflowed([u.mine for u in self.units], self.scaler, self.group, self.stats)
        coefficient = _clip(clip, [u.mine for u in self.units], scale, self.group)
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

    def param_tensors(self):
        return [u.mine.params for u in self.units]

    @property
    def comm_bytes(self) -> int:
        """The gathered parameters at their peak: a unit and the next one, prefetched."""
        return self.peak_gathered_bytes

    def close(self) -> None:
        self._comm.shutdown()
