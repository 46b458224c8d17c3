"""Lesson 11's demonstrations: context parallelism's pieces on one process (the online-softmax
merge, the causal balance), its attention timed on several ranks, and its memory against sequence
length.

    merge_parts(scores, split)      one query's softmax over its keys as two blocks merged by the
                                    log-sum-exp rule (context_parallel._block and _merge)
    merge_figure(parts)             the two blocks' weights, rescaled, against the full softmax
    merge_control()                 the same with the split point and the scores' spread as sliders
    causal_work(T, cp, balanced)    query-key pairs each rank's queries attend
    balance_figure(T, cps)          that work by rank, contiguous against balanced
    attend(method, q, k, v)         causal attention on one device or a CP method's share
    time_attention(...)             worker: causal attention's forward and backward on this rank,
                                    one device against each method, with the bytes sent
    memory_figure(cfg, lengths)     a rank's activations against sequence length, by cp
"""
from __future__ import annotations

import time

import ipywidgets as w
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from IPython.display import display

from minipar import comm
from minipar import context_parallel as cpm
from minipar import memory
from minipar.lessons.widgets import _panel


def merge_parts(scores: torch.Tensor, split: int) -> dict:
    """One query over len(scores) keys, its values the identity (so the output is the weights):
    the keys cut at `split` into two blocks, each block's (out, lse) by `context_parallel._block`,
    merged by `_merge`, beside the full softmax."""
    n = len(scores)
    q = scores[None, None, None, :].double()      # (B, H, 1 query, d = n): q k^T = scores
    keys = torch.eye(n, dtype=torch.float64)[None, None]
    pq = torch.tensor([n - 1])                    # the last position: every key is visible
    pos = torch.arange(n)
    scale = n ** 0.5                              # _scores divides by sqrt(d): undo it
    blocks = [(keys[:, :, a:b], pos[a:b]) for a, b in ((0, split), (split, n))]
    parts = [cpm._block(q * scale, k, k, pq, p) for k, p in blocks]
    (o1, l1), (o2, l2) = parts
    out, lse = cpm._merge(o1, l1, o2, l2)
    full = torch.softmax(scores.double(), -1)
    return dict(scores=scores, split=split, full=full, merged=out[0, 0, 0],
                lse=(l1.item(), l2.item(), lse.item()),
                blocks=[o[0, 0, 0] for o, _ in parts])


def merge_figure(parts: dict):
    """Each block's own softmax (what one rank computes), rescaled by exp(lse_i - lse), against the
    softmax over every key."""
    n, split = len(parts["full"]), parts["split"]
    l1, l2, lse = parts["lse"]
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.bar(range(n), parts["full"], color="#C8C8C8", label="softmax over all keys")
    for (a, b), o, li, colour in (((0, split), parts["blocks"][0], l1, "#4C72B0"),
                                  ((split, n), parts["blocks"][1], l2, "#DD8452")):
        ax.plot(range(a, b), (o * torch.exp(torch.tensor(li - lse)))[a:b], "o", color=colour,
                label=f"block keys {a}-{b - 1}: its softmax x exp(lse_i - lse), lse_i {li:.2f}")
    ax.axvline(split - 0.5, color="k", lw=0.8)
    ax.set(xlabel="key", ylabel="weight", title=f"merged lse {lse:.3f} = log(e^{l1:.2f} + "
                                                f"e^{l2:.2f})")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def merge_control(n: int = 12, split: int = 5, spread: float = 2.0) -> w.VBox:
    """Sliders for the split point and the scores' spread (seeded random scores); the merged
    weights redrawn over the full softmax's, with their largest difference."""
    controls = {"split": w.IntSlider(value=split, min=1, max=n - 1, description="split at key"),
                "spread": w.FloatSlider(value=spread, min=0.1, max=20.0,
                                        description="score spread")}

    def draw(split, spread):
        scores = torch.randn(n, generator=torch.Generator().manual_seed(0)) * spread
        parts = merge_parts(scores, split)
        out = w.Output()
        with out:
            fig = merge_figure(parts)
            display(fig)
            plt.close(fig)
            gap = (parts["merged"] - parts["full"]).abs().max()
            print(f"largest |merged - softmax|: {gap:.1e}")
        return out.outputs

    return _panel(controls, draw)


def causal_work(T: int, cp: int, balanced: bool) -> list[int]:
    """Query-key pairs each of cp ranks' queries attend under the causal mask."""
    return [cpm.causal_pairs(T, cp, r, balanced) for r in range(cp)]


def balance_figure(T: int, cps: tuple):
    """Each rank's causal work over the even share, T (T + 1) / (2 cp), contiguous against
    balanced, for each cp."""
    fig, axes = plt.subplots(1, len(cps), figsize=(3.2 * len(cps), 2.6), sharey=True)
    for ax, cp in zip(axes, cps):
        even = T * (T + 1) / 2 / cp
        for shift, balanced, colour in ((-0.2, False, "#C44E52"), (0.2, True, "#55A868")):
            ax.bar([r + shift for r in range(cp)], [x / even for x in causal_work(T, cp, balanced)],
                   width=0.4, color=colour, label="balanced" if balanced else "contiguous")
        ax.axhline(1, color="k", lw=0.8)
        ax.set(title=f"cp = {cp}", xlabel="rank", xticks=range(cp))
    axes[0].set_ylabel("work / even share")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def attend(method: str, q, k, v, stats=None):
    """(causal attention's output, the inputs it was given, requiring grad): "one device" runs
    F.scaled_dot_product_attention on the whole sequence of q, k, v (B, heads, T, d); a CP method
    its balanced share on the world group."""
    if method == "one device":
        mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        return F.scaled_dot_product_attention(*mine, is_causal=True), mine
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = [cpm.shard(t, n, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
    return cpm.attention(*mine, q.shape[2], None, method, True, stats), mine


def time_attention(tokens: int, heads: int, head_dim: int, reps: int, warmup: int = 1) -> dict:
    """Worker: {variant: seconds of each timed pass on this rank}, {variant: bytes sent a pass}.
    One device runs F.scaled_dot_product_attention on all `tokens`; each method its balanced
    share on this group. Inputs from one seed, the same on every rank."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, head_dim, generator=g) for _ in range(3))
    variants = ("one device", *cpm.METHODS)
    times, sent = {m: [] for m in variants}, {}
    for rep in range(warmup + reps):
        for i in range(len(variants)):
            method = variants[(rep + i) % len(variants)]
            stats = comm.CommStats()
            dist.barrier()
            start = time.perf_counter()
            out, _ = attend(method, q, k, v, stats)
            out.sum().backward()
            if rep >= warmup:
                times[method].append(time.perf_counter() - start)
            sent[method] = sum(stats.bytes_sent.values())
    return {"times": times, "sent": sent}


def memory_figure(cfg, lengths: list[int], cps: tuple, b: int = 1, e: int = 2):
    """A rank's activations (memory.activations, bf16, no recomputation) against sequence length,
    one device and context parallelism by ring and all-gather, GiB."""
    fig, ax = plt.subplots(figsize=(6.5, 3))
    for cp in cps:
        for method, style in (("ring", "-"), ("all-gather", "--")):
            if cp == 1 and method == "all-gather":
                continue
            gib = [sum(memory.activations(cfg.replace(seq_len=s), b, e, cp=(
                method, s // cp) if cp > 1 else None).values()) / 2**30 for s in lengths]
            ax.plot(lengths, gib, style, marker="o",
                    label="one device" if cp == 1 else f"cp {cp}, {method}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)",
           ylabel="activations a rank (GiB)", title=f"{cfg.n_layer} layers, h {cfg.d_model}, bf16")
    ax.set_xticks(lengths, [f"{s // 1024}K" for s in lengths])
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
