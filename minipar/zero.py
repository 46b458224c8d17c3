"""ZeRO: shard what data parallelism replicates (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models").

Every parameter lives in one flat buffer, padded to a multiple of the N data-parallel ranks and cut
into N equal shards; rank r owns shard r:

    flat = [ shard 0 | shard 1 | ... | shard N-1 ]      (params are views into it)
             rank 0    rank 1          rank N-1

  stage 1  optimizer state sharded: after backward the gradients are reduce-scattered (rank r gets
           the sum of shard r only: the first half of an all-reduce), rank r runs AdamW on its shard,
           and the updated shards are all-gathered back into every rank's flat buffer.
  stage 2  + gradients sharded: the same collectives, but each rank keeps only its gradient shard
           (here the full gradient lives from backward until the reduce-scatter, then is freed).

The optimizer is PyTorch's AdamW, run on per-parameter pieces of the shard (Parameters that alias
the flat buffer), so each element gets exactly the update the single-process run gives it.

Cost per rank, for P parameters in fp32 (K = 8 bytes of Adam moments per parameter), N ranks:
  memory    stage 0 (DP)  4P params + 4P grads + 8P optimizer
            stage 1       4P params + 4P grads + 8P/N optimizer
            stage 2       4P params + 4P/N grads + 8P/N optimizer
            (+ up to N-1 padding elements, + the comm scratch of the reduce-scatter)
  traffic   reduce-scatter + all-gather: (N-1)/N * 4P bytes each, 2(N-1)/N * 4P in all: the same as
            DP's all-reduce (the ZeRO paper's 2 Psi).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minipar import comm


class ZeroOptimizer:
    """AdamW with ZeRO stage 1 or 2 over `group`: call `step()` after backward (it syncs gradients too)."""

    def __init__(self, model: torch.nn.Module, group=None, stage: int = 1, lr: float = 1e-3,
                 weight_decay: float = 0.0, betas=(0.9, 0.95), collectives: str = "minipar"):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles stages 1 and 2, got {stage!r}")
        self.group, self.stage, self.collectives = group, stage, collectives
        single = not dist.is_initialized()  # one process, no group: shards of one, nothing to send
        self.size, self.rank = (1, 0) if single else (dist.get_world_size(group), dist.get_rank(group))
        self.params = [p for p in model.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        self.shard_size = -(-total // self.size)  # ceil: pad the flat buffer to N equal shards
        p0 = self.params[0]
        self.flat = torch.zeros(self.shard_size * self.size, dtype=p0.dtype, device=p0.device)
        self.ranges, offset = [], 0
        for p in self.params:  # move every parameter into the flat buffer, as a view
            self.flat[offset: offset + p.numel()].copy_(p.detach().view(-1))
            p.data = self.flat[offset: offset + p.numel()].view_as(p)
            self.ranges.append((offset, offset + p.numel()))
            offset += p.numel()
        lo, hi = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        self.shard = self.flat[lo:hi]
        self.grad_shard = torch.zeros_like(self.shard)
        groups = {True: [], False: []}  # decay? -> pieces
        self.pieces = []  # (piece Parameter, its slice of grad_shard)
        for p, (start, end) in zip(self.params, self.ranges):
            a, b = max(start, lo), min(end, hi)
            if a < b:  # this parameter overlaps my shard
                piece = torch.nn.Parameter(self.flat[a:b])  # aliases the flat buffer
                self.pieces.append((piece, self.grad_shard[a - lo: b - lo]))
                groups[p.dim() >= 2].append(piece)
        self.optimizer = torch.optim.AdamW(
            [dict(params=groups[True], weight_decay=weight_decay), dict(params=groups[False], weight_decay=0.0)],
            lr=lr, betas=betas)

    def step(self) -> None:
        """Average the gradients into my shard, update my shard, all-gather the parameters."""
        grads = torch.zeros_like(self.flat)
        for p, (start, end) in zip(self.params, self.ranges):
            if p.grad is not None:
                grads[start:end].copy_(p.grad.view(-1))
        if self.stage == 2:  # keep only the shard: the full gradient goes as soon as it is reduced
            for p in self.params:
                p.grad = None
        self.grad_shard.copy_(self._reduce_scatter(grads)).div_(self.size)
        del grads
        for piece, grad in self.pieces:
            piece.grad = grad
        self.optimizer.step()
        self._all_gather_into(self.flat, self.shard)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.grad_shard.zero_()

    def _reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        if self.collectives == "minipar":
            return comm.reduce_scatter(tensor, self.group)
        out = torch.empty(self.shard_size, dtype=tensor.dtype, device=tensor.device)
        comm.record("torch_reduce_scatter", (self.size - 1) * out.numel() * out.element_size(), 1)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.13
        reduce_scatter(out, tensor, group=self.group)
        return out

    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        if self.size == 1:
            return
        if self.collectives == "minipar":
            out.copy_(comm.all_gather(shard, self.group))
        else:
            comm.record("torch_all_gather", (self.size - 1) * shard.numel() * shard.element_size(), 1)
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
            all_gather(out, shard.clone(), group=self.group)

    # ----------------------------------------------------------------------------- accounting

    def state_tensors(self):
        """The optimizer state this rank holds (moments and step counters of its shard)."""
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def grad_tensors(self):
        """The gradients this rank keeps: all of them in stage 1, its shard in stage 2.

        (In stage 1 the reduced shard, `grad_shard`, is the reduce-scatter's output: a comm buffer.)"""
        if self.stage == 1:
            yield from (p.grad for p in self.params if p.grad is not None)
        else:
            yield self.grad_shard
