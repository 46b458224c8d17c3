"""Lesson 03's exercise and its grader (the style of `minipar.lessons.exercises`).

    check_sharded_step(fn)   shard an optimizer state: AdamW on this rank's shard of the flat
                             buffer, cut as minipar's ZeroOptimizer cuts it (zero.Flat)

The learner writes `fn(flat_param, flat_grad, state, rank, world, lr, betas, eps, weight_decay) ->
this rank's updated shard`: flat_param and flat_grad are the whole flat buffer of P elements (every
rank holds all the parameters in stages 1 and 2, and the gradient here is already the sum over
ranks), `state` a dict the rank keeps between steps (empty at the first). ZeroOptimizer pads the
buffer to N equal shards of ceil(P / N) elements; rank r owns elements [r s, (r + 1) s), the last
shard ending in padding. No communication is needed: the grader runs every rank in this process,
one after the other, then reassembles the shards as the all-gather would, and compares the weights
with torch.optim.AdamW on the whole buffer after every step. A reference answer is in
`minipar.lessons.solutions.sharded_adamw_step`.
"""
from __future__ import annotations

import torch

from minipar.zero import Flat

CASES = ((2, 11), (3, 11), (3, 7))  # (N, P): P divides by no N, so the last shard is padded
STEPS = 4
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def minipar_cut(numel: int, world: int, rank: int) -> tuple[int, int, int]:
    """(lo, hi, shard size) of rank's shard of a flat buffer of `numel` elements: zero.Flat's."""
    layout = Flat([torch.nn.Parameter(torch.empty(numel))], world, rank)
    return layout.lo, layout.hi, layout.shard_size


def _problem(numel: int, steps: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The initial flat parameter and one gradient per step: random, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g), [torch.randn(numel, generator=g) for _ in range(steps)]


def _reference(param: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch.optim.AdamW on the whole buffer: the weights after each step."""
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], **HYPER)
    out = []
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        out.append(p.detach().clone())
    return out


def _check_state(state: dict, rank: int, world: int, numel: int, size: int) -> None:
    held = {k: v.numel() for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() > 1}
    assert held, (f"rank {rank} keeps no optimizer state of its shard in `state` (AdamW's two "
                  f"moments, {size} elements each, belong there between steps)")
    for k, n in held.items():
        assert n <= size, (f"rank {rank}'s state[{k!r}] holds {n} elements, but its shard has "
                           f"{size}: each rank keeps the moments of its own shard only, 1/N of "
                           f"the {numel}-element buffer (that is ZeRO-1's saving)")


def check_sharded_step(fn, cases=CASES, steps: int = STEPS) -> str:
    """Grade `fn` (see the module's docstring) on every (N, P) of `cases`, `steps` AdamW steps
    each, against torch.optim.AdamW on the whole buffer; the weights must agree within 1% of one
    AdamW step (lr), as tests/test_zero.py judges ZeroOptimizer. Returns a short report."""
    lr = HYPER["lr"]
    for world, numel in cases:
        param, grads = _problem(numel, steps)
        expected = _reference(param, grads)
        cuts = [minipar_cut(numel, world, r) for r in range(world)]
        states, weights = [{} for _ in range(world)], param.clone()
        for step, (grad, want) in enumerate(zip(grads, expected), start=1):
            shards = []
            for rank, (lo, hi, size) in enumerate(cuts):
                shard = fn(weights.clone(), grad.clone(), states[rank], rank, world, **HYPER)
                assert isinstance(shard, torch.Tensor) and shard.dim() == 1, (
                    f"rank {rank} returned {type(shard).__name__}: expected a 1-D tensor, its "
                    "updated shard")
                assert shard.numel() == size, (
                    f"N = {world}, P = {numel}: rank {rank} returned {shard.numel()} elements; "
                    f"ZeroOptimizer pads the buffer to N equal shards of ceil(P/N) = {size} "
                    f"(zero.Flat.shard_size), rank r owning elements [r*{size}, (r+1)*{size}), the "
                    "last shard ending in padding")
                _check_state(states[rank], rank, world, numel, size)
                shards.append(shard.detach().clone())
            gathered = torch.cat(shards)[:numel]  # what the all-gather gives every rank
            far = (gathered - want).abs()
            if far.max() > 0.01 * lr:
                k = int(far.argmax())
                rank = k // cuts[0][2]
                lo, size = cuts[rank][0], cuts[rank][2]
                m = min(size, numel - lo)  # its elements before the padding
                at = [o for o in range(numel - m + 1)
                      if torch.allclose(shards[rank][:m], want[o:o + m], atol=0.01 * lr)]
                hint = (f" (rank {rank}'s shard holds the updates of elements [{at[0]}, "
                        f"{at[0] + m}), its own are [{lo}, {lo + m}): is the offset rank * "
                        f"ceil(P/N) = {rank} * {size}?)" if at and at[0] != lo else
                        " (check the update: AdamW's decoupled weight decay, the two moments, "
                        "their bias corrections 1 - beta^t with t counting this rank's steps, "
                        "eps outside the square root)")
                raise AssertionError(
                    f"N = {world}, P = {numel}, step {step}: element {k} (rank {rank}'s shard) is "
                    f"{gathered[k]:.6f}, torch.optim.AdamW gives {want[k]:.6f}: "
                    f"{far[k] / lr:.2f} lr apart, more than 1% of an AdamW step{hint}")
            weights = gathered
    shapes = ", ".join(f"N = {n}, P = {p}: shards of {-(-p // n)}" for n, p in cases)
    return (f"sharded AdamW correct: {steps} steps equal torch.optim.AdamW on the whole buffer "
            f"within 1% of lr, each rank keeping the moments of its shard only ({shapes})")
