"""Gradient clipping by the global norm, in any parallel layout (Pascanu et al. 2013, "On the
difficulty of training recurrent neural networks"; GPT-3 trains with it at 1.0).

Every gradient is multiplied by c = min(1, max_norm / (||g|| + 1e-6)), ||g|| the L2 norm of the
whole model's gradient, exactly as `torch.nn.utils.clip_grad_norm_` does on one process. In a
parallel layout no rank holds the whole gradient, so each rank adds up the squares of what it owns
and one all-reduce of that one number per group completes the sum:

    ||g||^2 = sum over the ranks of (sum over what the rank owns of g^2)

    what a rank holds              its gradient there                         weight  summed over
    a pipeline stage's layers      its own                                    1       pp group
    a TP-cut parameter (tp_dim)    its block of it                            1       tp group
    a TP-replicated parameter      the same on every TP rank                  1 on tp rank 0, else 0
    a ZeRO shard                   its piece of each flat buffer (padding 0)  1       dp group
    an expert cut by EP (.ep)      its experts'                               1       EP group
    plain DP                       the same on every replica: nothing to add

The gradients measured are the ones the optimizer steps: after DP's average (and SP's sum), the
fp32 master gradients under mixed precision, fp16's unscaled. The sum runs in float64, so adding
millions of squares over many ranks loses nothing the fp32 gradients hold.

Cost: one all-reduce of 8 bytes per group that holds different parts (counted in CommStats as
"grad_norm", as ZeRO counts its overflow flag), and one read of the gradients; nothing when off.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minipar.comm import CommStats


class ClipGradNorm:
    """One step's clipping: `coefficient(...)` measures the global norm, keeps it in `norm`, and
    returns the factor c to multiply every gradient by; the optimizer applies it.

    max_norm: the largest norm let through (> 0); groups: the process groups whose ranks hold
    different parts of the model (tp, pp; a sharding optimizer adds its own); tp_rank: this rank's
    place in the TP group, whose rank 0 alone counts the replicated parameters; stats: counts the
    all-reduces (None: not counted)."""

    def __init__(self, max_norm: float, groups: tuple = (), tp_rank: int = 0,
                 stats: CommStats | None = None):
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
                or not math.isfinite(max_norm) or max_norm <= 0:
            raise ValueError(f"max_norm must be a positive number (0 turns clipping off), got "
                             f"{max_norm!r}")
        self.max_norm, self.groups = float(max_norm), tuple(groups)
        self.tp_rank, self.stats = tp_rank, stats
        self.norm: float | None = None  # the global norm before clipping, once measured

    def counts(self, param) -> bool:
        """Whether this rank adds `param`'s gradient: its TP block, or a replicated parameter on TP
        rank 0 only (counted on every rank, it would weigh tp times)."""
        return hasattr(param, "tp_dim") or self.tp_rank == 0

    def coefficient(self, pieces, device, scale: float = 1.0, also: tuple = ()) -> float:
        """pieces: (gradient, parameter) pairs, this rank's part of the model's gradient (None:
        none), the parameter saying how it counts; `scale`: they are scale times the real ones
        (fp16's loss scale); also: more groups to sum over (a ZeRO optimizer's DP group).
        A collective: every rank of those groups calls it, an fp16 overflow too (the norm is then
        inf or nan)."""
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for grad, param in pieces:
            if grad is not None and self.counts(param) and not hasattr(param, "ep"):
                total += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
        experts = [(g, p) for g, p in pieces if hasattr(p, "ep")]
        if experts:  # each EP rank holds other experts: their squares add up over its EP group
            part = sum(torch.linalg.vector_norm(g, dtype=torch.float64).square()
                       for g, p in experts if g is not None and self.counts(p))
            part = torch.as_tensor(part, dtype=torch.float64, device=device).reshape(1)
            self._sum(part, experts[0][1].ep)
            total += part
        for group in (*also, *self.groups):
            self._sum(total, group)
        self.norm = total.sqrt().item() / scale
        return min(self.max_norm / (self.norm + 1e-6), 1.0)

    def _sum(self, total: torch.Tensor, group) -> None:
        """All-reduce one number over `group` (counted as "grad_norm"), if it has other ranks."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            if self.stats is not None:
                self.stats.record("grad_norm", total.element_size(), 1)
            dist.all_reduce(total, group=group)
