"""Lesson 12's demonstrations: a mixture-of-experts layer's routing drawn, its capacity as a
control, load balancing over a short training run, and expert parallelism's all-to-all on ranks.

    routing_figure(moe, x)          the router's scores for each token, its chosen experts, and the
                                    token-slots each expert receives
    capacity_control(...)           routed, kept and dropped slots by expert under a capacity factor
    balance_run(mode, steps)        a MoE layer trained from a router that sends most tokens to one
                                    expert: each step's busiest expert's load over the mean, with no
                                    balancing, Switch's loss, or DeepSeek-V3's bias rule
    exchange(tokens, ...)           worker: one MoE layer, expert parallel on this group, forward
                                    and backward on this rank's tokens: the slots it sends to each
                                    rank and the bytes by kind
"""
from __future__ import annotations

import ipywidgets as w
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from IPython.display import display

from minipar import comm
from minipar.expert_parallel import ExpertParallel
from minipar.lessons.widgets import _panel
from minipar.moe import MoE


def routing_figure(moe: MoE, x: torch.Tensor):
    """Scores (tokens x experts) with each token's chosen experts circled, and the slots per
    expert (kept, dropped)."""
    routing = moe.route(x)
    scores = torch.softmax(moe.router(x), -1).detach()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [3, 1]})
    a.imshow(scores.T, aspect="auto", cmap="Blues")
    for t, row in enumerate(routing.experts.tolist()):
        for j, e in enumerate(row):
            a.plot(t, e, "o", mfc="none", mec="#C44E52" if routing.kept[t, j] else "#999999")
    a.set(xlabel="token", ylabel="expert",
          title=f"router scores; circled: each token's {moe.top_k}")
    routed = torch.bincount(routing.experts.flatten(), minlength=moe.n_expert)
    b.barh(range(moe.n_expert), routing.counts, color="#4C72B0", label="kept")
    b.barh(range(moe.n_expert), routed - routing.counts, left=routing.counts, color="#C8C8C8",
           label="dropped")
    b.set(xlabel="token-slots", title="per expert")
    b.invert_yaxis()
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig, routing


def capacity_control(tokens: int = 32, n_expert: int = 8, top_k: int = 2, factor: float = 1.0):
    """A capacity-factor slider over one sequence's routing: routed and kept slots by expert."""
    controls = {"factor": w.FloatSlider(value=factor, min=0.25, max=3.0, step=0.25,
                                        description="capacity factor")}

    def draw(factor):
        torch.manual_seed(0)
        moe = MoE(16, 32, n_expert, top_k, capacity_factor=factor)
        x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(1))
        out = w.Output()
        with out:
            fig, routing = routing_figure(moe, x)
            display(fig)
            plt.close(fig)
            print(f"capacity {moe.capacity(tokens)} slots an expert: {routing.dropped} of "
                  f"{tokens * top_k} slots dropped")
        return out.outputs

    return _panel(controls, draw)


def balance_run(mode: str, steps: int = 80, n_expert: int = 8, top_k: int = 2, d: int = 16,
                seed: int = 0) -> list[float]:
    """Each step's busiest expert's slots over the mean, training a MoE layer to fit a fixed random
    two-layer map. The tokens share a mean direction u, and the router starts with 2 u on expert
    0, so most tokens pick it. mode "none": the fit's loss alone; "switch": plus Switch's balance
    loss (alpha 0.2: twenty times the paper's 0.01, so that a short run shows it); "bias":
    DeepSeek-V3's bias rule (step 0.01 a step), no balance loss."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    target = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.Tanh(), torch.nn.Linear(32, d))
    torch.manual_seed(seed)
    alpha = {"none": 0.0, "switch": 0.2, "bias": 0.0}[mode]
    moe = MoE(d, 32, n_expert, top_k, alpha=alpha, bias_speed=0.01 if mode == "bias" else 0.0)
    with torch.no_grad():
        moe.router.weight[0] += 2 * u
        for p in target.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    loads = []
    for _ in range(steps):
        x = torch.randn(4, 64, d, generator=g) + u   # 4 sequences of 64 tokens
        y, routing = moe(x)
        loss = (y - target(x).detach()).pow(2).mean() + routing.balance_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mode == "bias":
            moe.update_bias(routing.counts)
        loads.append((routing.counts.max() / routing.counts.float().mean()).item())
    return loads


def exchange(tokens: int, d: int = 32, f: int = 64, n_expert: int = 4, top_k: int = 2) -> dict:
    """Worker: one MoE layer (the same seed on every rank), its experts cut over this group, run
    forward and backward on this rank's own tokens. {"to": slots sent to each rank (self included),
    "sent": bytes by kind, "row": bytes a token's row}."""
    torch.manual_seed(0)
    layer = ExpertParallel(MoE(d, f, n_expert, top_k), None, stats := comm.CommStats())
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(1 + dist.get_rank()),
                    requires_grad=True)
    y, routing = layer(x)
    y.sum().backward()
    to = torch.bincount(routing.experts[routing.kept] // layer.local, minlength=layer.ep)
    return {"to": to.tolist(), "sent": dict(stats.bytes_sent), "row": d * 4}
