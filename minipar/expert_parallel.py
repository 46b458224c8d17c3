"""Expert parallelism: a mixture-of-experts layer's experts cut over the ranks of an EP group, each
rank's tokens sent to the ranks that hold their experts and the results brought back (GShard,
Lepikhin et al. 2021; DeepSpeed-MoE, Rajbhandari et al. 2022).

Every rank holds the router and n / ep experts (rank r: experts r n/ep ... (r+1) n/ep - 1) and
routes its own tokens exactly as the single-device layer would (`moe.MoE.route`, capacity counted
over this rank's tokens, GShard's "groups"). Then:

    counts     how many of my token-slots go to each expert: an all-to-all of n/ep counts per rank,
               so every rank knows how many rows it will receive from whom (the splits are uneven)
    dispatch   an all-to-all of the token rows, each rank's block sorted by expert
    experts    each local expert runs once on every row sent to it (from any rank; none is fine)
    combine    the outputs back by the reverse all-to-all, weighted by their gates and summed into
               the tokens' rows, as on one device

Bytes a rank sends, forward and backward, for rows of h elements of e bytes: 2 (a + b) h e, where a
is its slots bound for other ranks and b the slots other ranks send it (dispatch out, combine
back, each again reversed in the backward); plus the counts. Gradients: a local expert's are the
sum over every rank's tokens routed to it, as on one device; the router's are this rank's tokens'
(data parallelism across the EP group averages them, as it does every replicated weight).

In training (`ParallelConfig(ep=...)`), the EP group is ep consecutive ranks of the DP axis (EP
inside the DP group, as DeepSpeed-MoE and Megatron-LM place it), and the ranks that hold the same
experts, one in each EP group, are that expert's DP group (`groups_of`). An expert's gradient here
is the sum over its EP group's tokens; summed over its DP group too and divided by dp it is the
global batch's mean, which is how the DP reduction treats the expert weights (parallelize.apply_dp).
Each cut weight carries its EP group as `.ep`, for checkpoints and clipping.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from minipar import comm
from minipar.moe import EXPERT_WEIGHTS, MoE, Routing


class ExpertParallel(MoE):
    """`moe` with only this rank's n / ep experts (cut from it: every rank builds the full layer
    from one seed, then keeps its share), under the same names and routing rules; forward(x) ->
    (y, Routing), as MoE's."""

    def __init__(self, moe: MoE, group=None, stats: comm.CommStats | None = None):
        nn.Module.__init__(self)   # moe's settings and router, not fresh ones
        rank, ep, _ = comm._group_info(group)
        if moe.n_expert % ep:
            raise ValueError(f"expert parallelism {ep} must divide the experts ({moe.n_expert})")
        for name in MoE.SETTINGS:
            setattr(self, name, getattr(moe, name))
        self.group, self.stats, self.ep, self.rank = group, stats, ep, rank
        self.local = moe.n_expert // ep
        mine = slice(rank * self.local, (rank + 1) * self.local)
        self.router = moe.router
        for name in EXPERT_WEIGHTS[moe.mlp]:
            cut = nn.Parameter(getattr(moe, name).detach()[mine].clone())
            cut.ep = group
            setattr(self, name, cut)
        for name, buffer in moe.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name in moe.state_dict())

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing: Routing = self.route(x, math.prod(shape[:-2]))
        tokens, gates = self.slots(routing)                  # by expert, so by owner rank
        # counts first: [source rank][local expert] rows arrive here
        mine = routing.counts.to(torch.int64)
        arrive = torch.empty_like(mine)
        comm._record(self.stats, "ep_counts", (self.ep - 1) * self.local * 8, calls=1)
        dist.all_to_all_single(arrive, mine, group=self.group)
        sends = mine.view(self.ep, self.local).sum(1).tolist()
        per = arrive.view(self.ep, self.local)                          # (source, local expert)
        rows = comm.all_to_all(x[tokens], sends, per.sum(1).tolist(), self.group, self.stats,
                               "ep_dispatch")
        # the rows of each local expert, from every source in rank order
        blocks = rows.split(per.flatten().tolist())
        by_expert = [torch.cat([blocks[s * self.local + e] for s in range(self.ep)])
                     for e in range(self.local)]
        outs = [self.expert(e, part) for e, part in enumerate(by_expert)]
        # back to (source, expert) order, then home
        done = [outs[e].split(per[:, e].tolist()) for e in range(self.local)]
        back = torch.cat([done[e][s] for s in range(self.ep) for e in range(self.local)])
        home = comm.all_to_all(back, per.sum(1).tolist(), sends, self.group, self.stats,
                               "ep_combine")
        y = torch.zeros_like(x).index_add(0, tokens, home * gates.to(x.dtype)[:, None])
        return y.view(shape), routing


def groups_of(mesh, ep: int):
    """(this rank's EP group, its experts' DP group): ep consecutive ranks of the mesh's DP axis,
    and the dp / ep ranks at the same place of every EP group. Collective."""
    ep_group, same = mesh.dp_subgroups(lambda ranks: [ranks[i:i + ep] for i in range(
        0, len(ranks), ep)] + [ranks[i::ep] for i in range(ep)])
    return ep_group, same


def apply_ep(model: nn.Module, group, stats: comm.CommStats | None = None) -> None:
    """Every MoE layer of `model` (a GPT, its blocks' .mlp) cut over the EP group, in place."""
    for block in model.blocks:
        if isinstance(getattr(block, "mlp", None), MoE):
            block.mlp = ExpertParallel(block.mlp, group, stats)
