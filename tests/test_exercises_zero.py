"""Lesson 03's exercise: the grader passes the reference sharded AdamW and catches wrong ones."""
import re

import pytest
import torch

from minipar.lessons import demos_zero, exercises_zero, solutions


def every_rank_takes_shard_0(flat_param, flat_grad, state, rank, world, lr, **hyper):
    """Forgets the offset: every rank updates the first shard."""
    return solutions.sharded_adamw_step(flat_param, flat_grad, state, 0, world, lr, **hyper)


def splits_like_tensor_split(flat_param, flat_grad, state, rank, world, lr, betas=(0.9, 0.95),
                             eps=1e-8, weight_decay=0.0):
    """Cuts unevenly, as torch.tensor_split does (the first parts one longer), with no padding."""
    p = torch.tensor_split(flat_param, world)[rank].clone()
    g = torch.tensor_split(flat_grad, world)[rank]
    fake = torch.nn.functional.pad(p, (0, 0))  # the right update on the wrong cut
    return _adamw(fake, g, state, lr, betas, eps, weight_decay)


def no_bias_correction(flat_param, flat_grad, state, rank, world, lr, betas=(0.9, 0.95), eps=1e-8,
                       weight_decay=0.0):
    """The right shard, but Adam's moments used raw: the first steps are far too small."""
    size = -(-flat_param.numel() // world)
    pad = size * world - flat_param.numel()
    p = torch.nn.functional.pad(flat_param, (0, pad))[rank * size:(rank + 1) * size].clone()
    g = torch.nn.functional.pad(flat_grad, (0, pad))[rank * size:(rank + 1) * size]
    return _adamw(p, g, state, lr, betas, eps, weight_decay, corrected=False)


def floor_offset(flat_param, flat_grad, state, rank, world, lr, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.0):
    """Shards of ceil(P/N), but rank r's starting at r * (P // N): shifted by r elements."""
    size, step = -(-flat_param.numel() // world), flat_param.numel() // world
    padded = torch.nn.functional.pad(flat_param, (0, size))
    p = padded[rank * step:rank * step + size].clone()
    g = torch.nn.functional.pad(flat_grad, (0, size))[rank * step:rank * step + size]
    return _adamw(p, g, state, lr, betas, eps, weight_decay)


def keeps_full_moments(flat_param, flat_grad, state, rank, world, lr, **hyper):
    """Right weights, no saving: every rank keeps the moments of the whole buffer."""
    size = -(-flat_param.numel() // world)
    full = solutions.sharded_adamw_step(flat_param, flat_grad, state, 0, 1, lr, **hyper)
    return torch.nn.functional.pad(full, (0, size * world - full.numel()))[
        rank * size:(rank + 1) * size]


def _adamw(p, g, state, lr, betas, eps, weight_decay, corrected=True):
    if not state:
        state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
    state["step"] += 1
    t, (b1, b2) = state["step"], betas
    state["m"].mul_(b1).add_(g, alpha=1 - b1)
    state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
    c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if corrected else (1.0, 1.0)
    p.mul_(1 - lr * weight_decay)
    return p - lr * (state["m"] / c1) / ((state["v"] / c2).sqrt() + eps)


def test_the_sharded_adamw_answer_passes():
    report = exercises_zero.check_sharded_step(solutions.sharded_adamw_step)
    assert "N = 3, P = 11: shards of 4" in report


@pytest.mark.parametrize("wrong,message", [
    (every_rank_takes_shard_0, "its own are [6, 11): is the offset rank * ceil(P/N)"),
    (floor_offset, "holds the updates of elements [5, 10), its own are [6, 11)"),
    (splits_like_tensor_split, "ceil(P/N) = 6"),
    (no_bias_correction, "bias corrections"),
    (keeps_full_moments, "1/N of the 11-element buffer"),
])
def test_wrong_sharded_steps_are_caught(wrong, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        exercises_zero.check_sharded_step(wrong)


def test_the_cut_is_zero_flat():
    assert [exercises_zero.minipar_cut(11, 3, r) for r in range(3)] == [(0, 4, 4), (4, 8, 4),
                                                                       (8, 12, 4)]


def test_all_gather_time_is_half_the_ring_all_reduce():
    alpha, beta = 1e-4, 1e9
    assert demos_zero.all_gather_time(alpha, beta, 4e6, 4) == pytest.approx(3 * alpha + 3e6 / beta)
    sizes = [2**12, 2**16, 2**20]
    times = [demos_zero.all_gather_time(alpha, beta, s, 2) for s in sizes]
    assert demos_zero.fit_all_gather(sizes, [2] * 3, times) == pytest.approx((alpha, beta))


def test_gather_rows_reads_the_marks():
    """Two units on 2 ranks, one step: unit 1's gather hidden behind unit 0's forward, unit 0's
    exposed; in backward unit 0's gather queued behind another collective."""
    marks = [("ask", 0, 0.0), ("launch", 0, 0.0), ("start", 0, 0.0), ("end", 0, 1.0),
             ("got", 0, 1.0), ("launch", 1, 1.0), ("start", 1, 1.0), ("end", 1, 1.5),
             ("ask", 1, 3.0), ("got", 1, 3.0),
             ("ask", 1, 4.0), ("launch", 1, 4.0), ("start", 1, 4.0), ("end", 1, 4.5),
             ("got", 1, 4.5), ("launch", 0, 4.5), ("start", 0, 5.0), ("end", 0, 6.0),
             ("ask", 0, 5.5), ("got", 0, 6.0)]
    timing = dict(world=2, units=["a", "b"], unit_bytes=[100, 50],
                  steps=[dict(local=1.0, forward=3.0, backward=3.0, backward_start=3.5,
                              marks=marks)])
    rows = demos_zero.gather_rows(timing, alpha=0.2, beta=100.0)
    got = {(r["phase"], r["unit"]): r for r in rows}
    assert list(got) == [("forward", "a"), ("forward", "b"), ("backward", "b"), ("backward", "a")]
    assert got["forward", "b"]["window"] == 2.0 and got["forward", "b"]["verdict"] == "hidden"
    assert got["forward", "a"]["exposed"] == 1.0 and got["forward", "a"]["verdict"] == "exposed"
    assert got["backward", "a"]["queued"] == 0.5 and got["backward", "a"]["window"] == 1.0
    # predicted: 0.2 + 0.5 * 100 / 100 = 0.7 s, exposed 0.7 - (1.0 - 0.5) = 0.2
    assert got["backward", "a"]["exposed_predicted"] == pytest.approx(0.2)
    summary = demos_zero.step_summary(timing, rows)
    assert not summary["flagged"] and summary["measured"][0] == 6.0
