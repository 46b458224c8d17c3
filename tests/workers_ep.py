"""Workers for test_expert_parallel: each rank builds the full MoE layer from one seed, runs it on
its own tokens (the single-device reference), then its expert-parallel share on the same tokens."""
import copy

import torch
import torch.distributed as dist
from reference import rel_diff

from minipar import comm
from minipar.expert_parallel import ExpertParallel
from minipar.moe import MoE


def errors(n_expert, top_k, capacity=None, starve=None, h=8, f=16):
    """{what: relative difference} on this rank, bytes sent by kind, and the local experts' rows."""
    torch.set_num_threads(1)
    rank, ep, _ = comm._group_info(None)
    torch.manual_seed(0)
    full = MoE(h, f, n_expert, top_k, capacity_factor=capacity).double()
    if starve is not None:
        full.select_bias[starve] = -10.0   # that expert receives no token anywhere
    torch.manual_seed(1 + rank)
    x = torch.randn(9 + 4 * rank, h, dtype=torch.float64)   # uneven tokens per rank
    up = torch.randn_like(x)
    ref_x, ep_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = copy.deepcopy(full)
    y_ref, r_ref = ref(ref_x)
    (y_ref * up).sum().backward()
    stats = comm.CommStats()
    layer = ExpertParallel(copy.deepcopy(full), None, stats)
    y, routing = layer(ep_x)
    (y * up).sum().backward()
    out = {"output": rel_diff(y, y_ref), "dx": rel_diff(ep_x.grad, ref_x.grad),
           "router": rel_diff(layer.router.weight.grad, ref.router.weight.grad)}
    mine = slice(rank * layer.local, (rank + 1) * layer.local)
    for name in ("fc", "fc_bias", "proj", "proj_bias"):
        total = getattr(ref, name).grad.clone()
        dist.all_reduce(total)   # every rank's tokens' share of each expert's gradient
        got = getattr(layer, name).grad
        out[name] = rel_diff(got, total[mine]) if total[mine].norm() else got.abs().max().item()
    to = torch.bincount(routing.experts[routing.kept] // layer.local, minlength=ep).tolist()
    starved = None if starve is None or starve // layer.local != rank else \
        max(getattr(layer, n).grad[starve % layer.local].abs().max().item()
            for n in ("fc", "fc_bias", "proj", "proj_bias"))
    return out, dict(stats.bytes_sent), to, starved


def three_experts():
    """An EP layer of 3 experts on this group (refused when 3 does not divide over it)."""
    ExpertParallel(MoE(8, 16, 3, 1))
