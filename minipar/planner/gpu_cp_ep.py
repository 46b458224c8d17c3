"""The GPU cost of context and expert parallelism, per layer and micro-batch: the expert matmuls a
rank runs (`expert_matmuls`), the all-to-alls of expert parallelism (`ep_time`) and the exchanges
of context-parallel attention (`cp_times`). gpu_time.layer_cost adds them to a layer's cost; the
routing is taken even, the sequence split balanced.
"""
from __future__ import annotations

import math

from minipar.planner.links import all_to_all, exposed, gather_or_scatter, p2p

# w below: a gpu_time.Work, how one GPU runs one micro-batch (its b, t, e, cp and ep, their links)


def expert_matmuls(cfg, b: int, ep: int) -> list[tuple[tuple[int, int, int], int]]:
    """((m, n, k), how many) of a MoE layer's expert matmuls on one of ep ranks, the routing even:
    its n / ep experts each take ep b s k / n rows (its share of its EP group's token-slots):
    fc (and SwiGLU's gate) (rows, f, h), proj (rows, h, f). None for a dense model."""
    if not cfg.n_expert:
        return []
    n, h, f = cfg.n_expert, cfg.d_model, cfg.ffn_dim
    rows, count = math.ceil(ep * b * cfg.seq_len * cfg.top_k / n), n // ep
    return [((rows, f, h), count)] * (2 if cfg.mlp == "swiglu" else 1) + [((rows, h, f), count)]


def ep_time(cfg, w) -> float:
    """Seconds of a MoE layer's expert-parallel exchanges in one pass (forward or backward: the
    dispatch and the combine, each an all-to-all of the b s k token-slots' rows, h e bytes each,
    the routing even; the counts' exchange, a latency), exposed: expert_parallel.py waits for each
    before it goes on."""
    if w.ep == 1:
        return 0.0
    rows = w.b * cfg.seq_len * cfg.top_k * cfg.d_model * w.e
    return 2 * all_to_all(rows, w.ep, w.ep_link) + (w.ep - 1) * w.ep_link.latency


def cp_times(cfg, w, core: float) -> tuple[float, float]:
    """(forward, backward) seconds a layer's context-parallel attention adds (context_parallel.py's
    exchanges, K/V of b s / cp tokens, kv / t wide: X = 2 b s kv e / (cp t) bytes a block):
        ring        forward: cp - 1 blocks passed on, each under the attention of the block held
                    (`exposed`: the core's forward, `core`, cut in cp); backward: cp - 1 times
                    K, V, dK, dV (2 X) and the last dK, dV home (X), each waited for
        all-gather  all-gather of K and V (cp X), backward their reduce-scatter: waited for
        ulysses     all-to-all of q, k, v (b s (h + 2 kv) e / (cp t)) and of the output (b s h e /
                    (cp t)), forward and (reversed) backward: waited for"""
    if w.cp == 1:
        return 0.0, 0.0
    cp, link, s = w.cp, w.cp_link, cfg.seq_len
    block = 2 * w.b * s * cfg.kv_dim * w.e / (cp * w.t)
    if w.cp_method == "ring":
        forward = (cp - 1) * exposed(p2p(block, link), core / cp)
        return forward, (cp - 1) * p2p(2 * block, link) + p2p(block, link)
    if w.cp_method == "all-gather":
        gather = gather_or_scatter(cp * block, cp, link)
        return gather, gather
    mine = w.b * s * w.e / (cp * w.t)
    swaps = all_to_all(mine * (cfg.d_model + 2 * cfg.kv_dim), cp, link) + \
        all_to_all(mine * cfg.d_model, cp, link)
    return swaps, swaps
