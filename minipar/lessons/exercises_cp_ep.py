"""Exercises of lessons 11 (context parallelism) and 12 (experts), and their graders, in the style
of `minipar.lessons.exercises` (a grader returns a short report on a right answer and raises
AssertionError, saying what went wrong, on a wrong one; reference answers: `solutions`).

    check_merge(fn)   lesson 11: two partial attentions of the same queries over disjoint keys,
                      merged by the log-sum-exp rule, against context_parallel._merge and the
                      softmax over every key
    check_route(fn)   lesson 12: top-k routing with an expert capacity, first come first served,
                      against moe.MoE.route

No processes: both are functions of tensors, run here.
"""
from __future__ import annotations

import torch

from minipar import context_parallel as cpm
from minipar.moe import MoE


def _blocks(seed: int, scale: float):
    """q (1 head, 4 queries) over 10 keys cut in two blocks (keys 0-2, 3-9), causal by position,
    scores times `scale`: (each block's (out, lse), the attention over all keys). Query 0 sits
    before every key: it sees none (out 0, lse -inf, as the ring's accumulator starts); query 1
    sees none of the second block's."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, 3, generator=g, dtype=torch.float64) for n in (4, 10, 10))
    q = q * scale
    pq, pk = torch.tensor([-1, 1, 7, 9]), torch.arange(10)
    parts = [cpm._block(q, k[:, :, a:b], v[:, :, a:b], pq, pk[a:b]) for a, b in ((0, 3), (3, 10))]
    return parts, cpm._block(q, k, v, pq, pk)


def check_merge(fn) -> str:
    """fn(out1, lse1, out2, lse2) -> (out, lse): out_i (B, H, queries, d) each block's attention
    output (its softmax over its own keys times their values), lse_i (B, H, queries) the
    log-sum-exp of its scores (-inf for a query that sees none of its keys). Checked against
    attention over all the keys on ordinary scores, on scores of thousands (where exp overflows)
    and with queries that see no key of a block, or of either (out 0, lse -inf)."""
    for seed, scale in ((0, 1.0), (1, 2000.0)):
        ((o1, l1), (o2, l2)), (full, lse_full) = _blocks(seed, scale)
        got = fn(o1.clone(), l1.clone(), o2.clone(), l2.clone())
        assert isinstance(got, tuple) and len(got) == 2, "return (out, lse), a pair of tensors"
        out, lse = got
        assert out.shape == full.shape and lse.shape == lse_full.shape, (
            f"shapes: out {tuple(out.shape)} and lse {tuple(lse.shape)}, expected "
            f"{tuple(full.shape)} and {tuple(lse_full.shape)}")
        assert torch.isfinite(out).all(), (
            "non-finite outputs (scores in the thousands overflow exp; a query may see no key): "
            "weigh each block by exp(lse_i - lse), never exp(lse_i) alone (it overflows), "
            "and where lse is -inf (no key at all) the output is 0")
        assert torch.equal(lse.isinf(), lse_full.isinf()) and torch.allclose(
            lse.masked_fill(lse.isinf(), 0), lse_full.masked_fill(lse_full.isinf(), 0), rtol=0,
            atol=1e-9), "lse is not log(exp(lse1) + exp(lse2)) (torch.logaddexp computes it)"
        assert torch.allclose(out, full, rtol=0, atol=1e-9), (
            f"the merged output is not attention over every key (largest difference "
            f"{(out - full).abs().max():.2e}): each block's output counts in proportion to its "
            "share of the total exp-sum, exp(lse_i - lse)")
    return "merge: equal to attention over every key, at scores in the thousands, keys masked"


def check_route(fn) -> str:
    """fn(scores, k, capacity) -> (experts, kept): scores (T, n) the router's probabilities of one
    sequence, experts (T, k) each token's k highest-scoring experts (best first), kept (T, k) bool:
    whether that slot fits its expert's `capacity`, first come first served in token order, a
    token's slots in the order of its experts. Checked against moe.MoE.route."""
    for seed, (T, n, k, capacity) in enumerate([(12, 4, 2, 5), (16, 5, 1, 2), (9, 3, 3, 9),
                                                (20, 6, 2, 3)]):
        g = torch.Generator().manual_seed(seed)
        scores = torch.softmax(torch.randn(T, n, generator=g) * 2, -1)
        moe = MoE(n, 1, n, k, capacity_factor=(capacity - 0.5) * n / (T * k))
        with torch.no_grad():
            moe.router.weight.copy_(torch.eye(n))
        want = moe.route(torch.log(scores))   # softmax(log p) = p: the router scores `scores`
        assert moe.capacity(T) == capacity
        got = fn(scores.clone(), k, capacity)
        assert isinstance(got, tuple) and len(got) == 2, "return (experts, kept)"
        experts, kept = got
        assert torch.equal(torch.as_tensor(experts), want.experts), (
            f"T={T}, n={n}, k={k}: the chosen experts differ: each token's k best, best first "
            "(torch.topk)")
        kept = torch.as_tensor(kept, dtype=torch.bool)
        if not torch.equal(kept, want.kept):
            t, j = (kept != want.kept).nonzero()[0].tolist()
            raise AssertionError(
                f"T={T}, n={n}, k={k}, capacity {capacity}: the kept slots differ, first at token "
                f"{t}'s slot {j} (expert {int(want.experts[t, j])}): expected "
                f"{'kept' if want.kept[t, j] else 'dropped'}. An expert keeps its first "
                "`capacity` slots in token order (token 0's slots, then token 1's...) and drops "
                "the rest")
    return "route: the same experts and the same kept slots as MoE.route, capacity or not"

