"""Context parallelism (context_parallel.py): causal attention over a sequence split across ranks.

Each method's output and its q, k, v gradients equal the single-device attention's, restricted to
the rank's tokens (float64, so to rounding), at cp 2 and 3, lengths that do not divide evenly, with
grouped-query attention, balanced and contiguous; the bytes each rank sends equal `sent`'s
formulas; the balanced split evens out the causal work.
"""
import pytest
import workers_cp

import minipar
from minipar import context_parallel as cpm

CASES = [("ring", 2, 12, 4, 2, True), ("ring", 3, 13, 6, 3, True), ("ring", 3, 11, 6, 2, False),
         ("ring", 4, 17, 4, 1, True), ("all-gather", 2, 12, 4, 2, True),
         ("all-gather", 3, 13, 6, 3, True), ("all-gather", 3, 10, 6, 2, False),
         ("ulysses", 2, 12, 4, 2, True), ("ulysses", 3, 13, 6, 3, True),
         ("ulysses", 3, 7, 3, 3, False)]


@pytest.mark.parametrize("method,cp,seq_len,hq,hk,balanced", CASES)
def test_every_method_equals_single_device_attention_and_sends_what_it_says(
        method, cp, seq_len, hq, hk, balanced):
    ranks = minipar.launch(workers_cp.attention_errors, cp, method, seq_len, hq, hk, balanced,
                           timeout=120)
    for rank, (errors, sent, calls) in enumerate(ranks):
        assert max(errors.values()) < 1e-12, (rank, errors)
        assert sent == cpm.sent(method, seq_len, cp, rank, 2, hq, hk, 8, 8, balanced), rank


def test_the_balanced_split_evens_out_the_causal_work():
    for cp, seq_len in ((2, 64), (4, 1024), (3, 1000)):
        balanced = [cpm.causal_pairs(seq_len, cp, r) for r in range(cp)]
        contiguous = [cpm.causal_pairs(seq_len, cp, r, balanced=False) for r in range(cp)]
        total = seq_len * (seq_len + 1) // 2
        assert sum(balanced) == sum(contiguous) == total
        assert max(balanced) / min(balanced) < 1.01   # every rank about T^2 / (2 cp)
        assert max(contiguous) / min(contiguous) > 2 * cp - 1.5   # the last rank's vs the first's


def test_positions_cover_the_sequence_once():
    for cp, seq_len in ((1, 5), (2, 4), (3, 13), (4, 17)):
        for balanced in (True, False):
            held = sorted(int(p) for r in range(cp)
                          for p in cpm.positions(seq_len, cp, r, balanced))
            assert held == list(range(seq_len))
    assert cpm.positions(8, 2, 0).tolist() == [0, 1, 6, 7]   # chunks 0 and 3 of 4


@pytest.mark.parametrize("args,message", [((3, 2, 0), "shorter than the 4 chunks"),
                                          ((8, 0, 0), "positive integer"),
                                          ((8, 2, 2), "rank in")])
def test_a_split_that_cannot_work_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        cpm.positions(*args)


def test_pytorchs_context_parallel_does_not_run_on_this_cpu():
    # the peer of the bench: torch.distributed.tensor.experimental.context_parallel replaces the
    # CUDA SDPA kernels (flash, efficient, cuDNN) with its ring; on a CPU the SDPA op it meets has
    # no sharding rule, and the math backend mixes plain tensors with DTensors. When a torch runs
    # it here, this test fails: then compare it side by side (bench/)
    flash, math = (minipar.launch(workers_cp.torch_context_parallel, 2, m, timeout=120)[0]
                   for m in (False, True))
    assert "_scaled_dot_product_flash_attention_for_cpu" in flash and "sharding" in flash
    assert "mixed torch.Tensor and DTensor" in math
