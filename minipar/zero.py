"""ZeRO stages 1 and 2: shard what data parallelism replicates (Rajbhandari et al. 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models"); stage 3 is zero3.py.

Parameters are laid out in flat buffers, each padded to a multiple of the N data-parallel ranks and
cut into N equal shards; rank r owns shard r of each:

    flat = [ shard 0 | shard 1 | ... | shard N-1 ]      (parameters are views into it)
             rank 0    rank 1          rank N-1

  stage 1  optimizer state sharded: the gradients are reduce-scattered (rank r gets the sum of
           shard r only: the first half of an all-reduce), rank r runs AdamW on its shard, and the
           updated shards are all-gathered back into every rank's flat buffers.
  stage 2  + gradients sharded: each rank keeps only its gradient shards; a full gradient buffer
           lives only until it is reduced.
Two versions, simplest first (ParallelConfig.dp_mode):
  "naive"     one flat buffer of every parameter; its gradients accumulate through backward and
              are reduce-scattered once, after it. Stage 2 frees the full gradient only then, so
              its peak is stage 1's: the saving shows only after the step.
  "bucketed"  the flat buffers are data_parallel.GradBuckets' buckets, in backward's order: each is
              reduce-scattered on the communication thread as soon as its gradients are in,
              overlapping the rest of backward. Stage 2 reduces every micro-batch's buckets into its
              shards and frees each full buffer once reduced, at most two alive at once (one
              filling, one in flight): DeepSpeed's stage 2, FSDP2 with reshard_after_forward=False.

The optimizer is PyTorch's AdamW, run on per-parameter pieces of the shard (Parameters that alias
the shard), so each element gets exactly the update the single-process run gives it.
Mixed precision (bf16, fp16): parameters live and travel in 16 bits; each rank keeps an fp32 master
copy of its shard only, which AdamW updates and which is rounded back into the 16-bit shard before
the all-gather. Gradients accumulate and are reduced in fp32 by default (grad_dtype), 16 bits as an
option: 2 + 4 + K or the ZeRO paper's 2 + 2 + K bytes a parameter, K = 12. In fp16 the gradients
are unscaled in fp32, and since each rank sees only its shard, an overflow flag is all-reduced (one
float) so that all ranks skip the step together; clipping by the global norm likewise adds up each
rank's sum of squares over its shard (clip.py).

Cost per rank, for P parameters in fp32 (8 bytes of Adam moments per parameter), N ranks, B the
largest bucket's gradient bytes:
  memory    stage 0 (DP)  4P params + 4P grads + 8P optimizer
            stage 1       4P params + 4P grads + 8P/N optimizer
            stage 2       4P params + 4P/N grads + 8P/N optimizer, + the full buffers alive:
                          naive 4P (through backward), bucketed at most 2B
            (+ up to N-1 padding elements per flat buffer, + the ring's receive space from the
            step's first reduction to its end.) Every
            reduce-scatter lands in place, in the rank's own shard of the bucket (the layout NCCL
            reduces in place; gloo copies): stage 1's reduced gradients are slices of its buckets,
            stage 2 copies each out as the bucket is freed. Stage 2's reduced shards live from the
            step's first reduction to zero_grad, as FSDP2's sharded gradients do.
  traffic   reduce-scatter + all-gather, (N-1)/N * 4P bytes each: 2 Psi, as in DP; bucketed
            stage 2 reduce-scatters every micro-batch (M micro-batches: M + 1 Psi)
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from minipar import comm, data_parallel
from minipar.tensor_parallel import sequence_partial, sync_sequence_parallel_grads


class Flat:
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


class Shard:
    """What a rank keeps of one flat buffer: its shard of the parameters (in the compute dtype), of
    the gradients (fp32 by default under mixed precision, accumulated and reduced in fp32; or
    16-bit, the ZeRO paper's accounting), the fp32 master copy of its parameter shard (mixed
    precision only) and AdamW on it."""

    def __init__(self, layout: Flat, params: torch.Tensor, master: torch.Tensor | None, lr,
                 weight_decay, betas, grads: torch.Tensor | None = None):
        self.params, self.master = params, master
        self.grads = grads  # the owner's: set from each step's reduction
        updated = self.params if master is None else master
        self.optimizer, self.pieces, self.owners = layout.adamw(updated, lr, weight_decay, betas)

    def update(self, loss_scale: float = 1.0, coefficient: float = 1.0) -> None:
        """AdamW on the shard (with fp32 gradients when there are masters), on the gradients
        unscaled and times `coefficient` (clipping's), then round into params."""
        # with masters, fp32 gradients (a transient copy of 16-bit ones only)
        grads = self.grads.float() if self.master is not None else self.grads
        if loss_scale != 1.0 or coefficient != 1.0:  # a power of 2 divides exactly
            grads.mul_(coefficient / loss_scale)  # in place: the shard is refilled every step
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


def overflowed(shards: list, scaler, group, stats: comm.CommStats | None) -> bool:
    """fp16: whether any rank's gradient shard holds an inf or nan (then every rank skips the step),
    and the loss scaler told. Without a scaler (fp32, bf16) never."""
    if scaler is None:
        return False
    flag = (~torch.stack([torch.isfinite(s.grads).all() for s in shards]).all()).float().reshape(1)
    if group_size_rank(group)[0] > 1:  # one float: the ranks must agree, each sees only its shard
        if stats is not None:
            stats.record("overflow_flag", 4, 1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    scaler.update(bool(flag.item()))
    return bool(flag.item())


def clip_coefficient(clip, shards: list, scale: float, group) -> float:
    """Clipping's coefficient (1.0 without clip), over the pieces of all the group's shards."""
    owned = [(s.grads[a:b], p) for s in shards for (_, a, b), p in zip(s.pieces, s.owners)]
    return clip.coefficient(owned, shards[0].params.device, scale, also=(group,)) if clip else 1.0


def group_size_rank(group) -> tuple[int, int]:
    """(N, rank) of the group; one process with no group is a group of one."""
    return (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)


def reduce_shard(tensor: torch.Tensor, group, ops: comm.Collectives, out) -> torch.Tensor:
    """My shard of the sum of `tensor` over the group (its length divides by the group size), into
    `out`."""
    n, _ = group_size_rank(group)
    return out.copy_(tensor) if n == 1 else ops.reduce_scatter(tensor, group, out=out)


def gather_shards(shard: torch.Tensor, group, ops: comm.Collectives, out=None) -> torch.Tensor:
    """Every rank's shard, concatenated in rank order (into `out`, which may hold the shard)."""
    n, _ = group_size_rank(group)
    if n > 1:
        return ops.all_gather(shard, group, out=out)
    return shard if out is None else out.copy_(shard)


class ZeroOptimizer:
    """AdamW with ZeRO stage 1 or 2 over `group`: call `step()` after backward (it syncs too).

    The gradients accumulate in data_parallel.GradBuckets, reduce-scattered: bucket_bytes None is
    the simple version, one flat buffer of every gradient, reduce-scattered once after backward
    (stage 2 frees it then, so its peak is stage 1's); a size cuts the parameters into buckets in
    backward's order, each reduce-scattered on the communication thread as soon as its gradients
    are in, and in stage 2 freed once reduced, every micro-batch (DeepSpeed's stage 2). Each bucket
    is also a flat parameter buffer of its own, padded to N shards; rank r owns shard r of each.

    dtype, master: the parameters' dtype, and whether to keep fp32 master shards (mixed precision);
    grad_dtype: the gradients' (default dtype; fp32 accumulates 16-bit gradients in fp32); scaler:
    fp16's LossScaler, whose scale multiplied the loss (None otherwise); stats: the CommStats that
    counts what it sends (None: not counted)."""

    def __init__(self, model: torch.nn.Module, group=None, stage: int = 1, lr: float = 1e-3,
                 weight_decay: float = 0.0, betas=(0.9, 0.95), collectives: str = "minipar",
                 dtype=torch.float32, master: bool = False, scaler=None,
                 stats: comm.CommStats | None = None, bucket_bytes: int | None = None,
                 grad_dtype=None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles stages 1 and 2, got {stage!r}")
        self.group, self.stage, self.collectives = group, stage, collectives
        self.scaler, self.stats = scaler, stats
        self.ops = comm.implementation(collectives, stats, comm.Scratch())
        self.size, rank = group_size_rank(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        grad_dtype = grad_dtype or dtype
        element = torch.empty(0, dtype=grad_dtype).element_size()
        groups = [self.params] if bucket_bytes is None else \
            data_parallel.buckets_of(self.params, bucket_bytes, element)
        layouts = [Flat(params, self.size, rank) for params in groups]
        fulls = []
        for layout, params in zip(layouts, groups):
            fp32 = layout.flatten(params)  # the fp32 initialisation, before any cast
            fulls.append((fp32.to(dtype), fp32[layout.lo:layout.hi].clone() if master else None))
            layout.point_params_at(fulls[-1][0])
        # after the parameters point at their buffers: the hooks hold the final parameters
        self.grads = data_parallel.GradBuckets(
            self.params, groups, group, dtype=grad_dtype, overlap=bucket_bytes is not None,
            scatter=True, keep=stage == 1, collectives=collectives, stats=stats)
        # (layout, full parameter buffer, my shard, whose gradient is the bucket's reduced shard)
        self.flats = [(layout, full, Shard(layout, full[layout.lo:layout.hi], master_shard, lr,
                                            weight_decay, betas, grads=bucket.reduced))
                      for layout, (full, master_shard), bucket
                      in zip(layouts, fulls, self.grads.buckets)]

    @property
    def shards(self) -> list:
        return [mine for _, _, mine in self.flats]

    def step(self, clip=None, sp=None) -> None:
        """Wait for the reduced gradient shards, update my shards, all-gather the parameters.
        clip: a ClipGradNorm, to scale the gradients by the global norm (its `norm`) first; sp: the
        TPGroup whose sequence parallelism leaves some gradients partial (summed over it here: each
        TP rank's buckets are cut alike)."""
        self.grads.finish()
        for mine, bucket in zip(self.shards, self.grads.buckets):
            mine.grads = bucket.reduced
        if sp:
            sync_sequence_parallel_grads([mine.grads[a:b] for mine in self.shards
                                          for (_, a, b), p in zip(mine.pieces, mine.owners)
                                          if sequence_partial(p)], sp)
        scale = self.scaler.scale if self.scaler else 1.0  # read before an overflow backs it off
        overflow = overflowed(self.shards, self.scaler, self.group, self.stats)
        coefficient = clip_coefficient(clip, self.shards, scale, self.group)
        if overflow:
            return  # fp16 overflow: nothing changed, nothing to gather
        for _, full, mine in self.flats:
            mine.update(scale, coefficient)
            gather_shards(mine.params, self.group, self.ops, out=full)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for mine in self.shards:
            mine.grads = None  # stage 2's are freed; the next step's reduction sets them
        self.grads.zero_grad()

    @property
    def param_groups(self) -> list[dict]:  # a torch optimizer's: where the learning rate is set
        return [group for mine in self.shards for group in mine.optimizer.param_groups]

    def state_tensors(self):
        """The optimizer state this rank holds: its shards' masters, moments and step counts."""
        for mine in self.shards:
            yield from mine.state_tensors()

    def grad_tensors(self):
        """The gradients this rank holds now: the full buffers (stage 1 always, its reduced
        shards are slices of them; stage 2 while they wait to be reduced) and stage 2's reduced
        shards (from the step's first reduction to zero_grad)."""
        if self.stage == 1:
            return self.grads.buffers()
        return self.grads.buffers() + [b.reduced for b in self.grads.buckets
                                       if b.reduced is not None]

    def param_tensors(self):
        return [full for _, full, _ in self.flats]  # padding included

    def comm_tensors(self):
        """The ring's receive space."""
        return list(self.grads.scratch.buffers.values())

    @property
    def comm_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.comm_tensors())

    def close(self) -> None:
        self.grads.close()
