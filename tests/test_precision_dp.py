"""Mixed precision through minipar.train: data parallelism reproduces the single-process run of the
same precision within 16-bit bounds, and each rank holds 2 + 4 + 12 bytes a parameter (fp32 gradients,
Megatron-LM's 18 bytes), or the ZeRO paper's 2 + 2 + 12 with 16-bit gradients (reduce_fp32=False).

Bounds (measured: losses within 2.3e-5, whole-model weights within 7.6e-4 at dp 2 and 4): the 16-bit
matmuls of a half batch need not round like those of the whole batch, and one bf16 rounding step of a
weight is 2^-8 of it; fp32 is held to 1e-5 by the other tests.
"""
import pytest
import torch
import workers_dp
from reference import rel_diff

import minipar
from minipar import GPTConfig, ParallelConfig

TINY = GPTConfig.preset("tiny")
STEPS, BATCH = 4, 12
PRECISIONS = ("bf16", "fp16", "pure-bf16")


def flat(state):
    return torch.cat([state[k].double().flatten() for k in sorted(state)])


@pytest.fixture(scope="module")
def references():
    return {p: minipar.train(TINY, ParallelConfig(precision=p), steps=STEPS, global_batch=BATCH, lr=1e-3,
                             weight_decay=0.1, return_state=True) for p in PRECISIONS}


@pytest.mark.parametrize("dp", [2, 3])
def test_data_parallel_matches_the_single_process_run_in_16_bits(dp, references):
    cases = [ParallelConfig(dp=dp, precision=p) for p in PRECISIONS]
    ranks = minipar.launch(workers_dp.train_variants, dp, TINY, cases, STEPS, BATCH, timeout=120)
    for i, par in enumerate(cases):
        got, ref = ranks[0][i], references[par.precision]
        assert max(abs(a - b) / b for a, b in zip(got.losses, ref.losses)) < 1e-4, par.label
        assert rel_diff(flat(got.state_dict), flat(ref.state_dict)) < 2e-3, par.label
        assert all(v.dtype == torch.bfloat16 if par.precision != "fp16" else v.dtype == torch.float16
                   for v in got.state_dict.values())


@pytest.mark.parametrize("precision,per_param,fp32_grads", [
    ("fp32", (4, 4, 8), True), ("bf16", (2, 4, 12), True), ("fp16", (2, 4, 12), True),
    ("bf16", (2, 2, 12), False), ("fp16", (2, 2, 12), False), ("pure-bf16", (2, 2, 4), True)])
def test_bytes_per_parameter(precision, per_param, fp32_grads):
    par = ParallelConfig(dp=2, precision=precision, reduce_fp32=fp32_grads or precision == "fp32")
    res = minipar.train(TINY, par, steps=1, global_batch=4)
    mem, psi, tensors = res.peak_memory[0], TINY.num_params, len(minipar.GPT(TINY).state_dict())
    assert (mem["params"], mem["grads"]) == (per_param[0] * psi, per_param[1] * psi)
    assert mem["optimizer"] == per_param[2] * psi + 4 * tensors  # + Adam's step counters
    # gradients are all-reduced in fp32 (the masters' .grad) unless told, or the whole run is 16-bit
    wire = per_param[1]
    assert sum(res.comm_bytes[0].values()) == pytest.approx(2 * 1 / 2 * wire * psi, abs=4 * 2 * tensors)


@pytest.mark.parametrize("dp", [2, 3])
def test_zero_in_16_bits_matches_the_single_process_run(dp, references):
    """ZeRO keeps fp32 master shards and accumulates and reduce-scatters fp32 gradients (pure-bf16:
    16-bit ones)."""
    cases = [ParallelConfig(dp=dp, zero=z, precision=p) for p in ("bf16", "fp16", "pure-bf16") for z in (1, 2, 3)]
    ranks = minipar.launch(workers_dp.train_variants, dp, TINY, cases, STEPS, BATCH, timeout=120)
    for i, par in enumerate(cases):
        got, ref = ranks[0][i], references[par.precision]
        assert max(abs(a - b) / b for a, b in zip(got.losses, ref.losses)) < 1e-4, par.label
        assert rel_diff(flat(got.state_dict), flat(ref.state_dict)) < 5e-3, par.label
        shard = -(-TINY.num_params // dp)  # elements of a shard (one flat buffer, stages 1, 2)
        grad = 2 if par.precision == "pure-bf16" else 4  # gradients reduced in fp32
        if par.zero < 3:  # parameters gathered in 16 bits
            assert got.comm.items() >= {"reduce_scatter": STEPS * (dp - 1) * shard * grad,
                                        "all_gather": STEPS * (dp - 1) * shard * 2}.items()


def test_zero_fp16_overflow_skips_the_step_on_every_rank():
    """An inf in one rank's gradient shard: every rank skips (the flag is all-reduced), the scale halves."""
    ranks = minipar.launch(workers_dp.zero_fp16_overflow, 2, TINY, timeout=120)
    for changed, scales in ranks:
        assert changed == [False, True]           # step 1 skipped (inf injected on rank 1), step 2 taken
        assert scales == [2.0**15, 2.0**15]       # backed off once, not grown in one good step


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reducing_16_bit_gradients_halves_the_bytes(precision, references):
    """The trade-off of reduce_fp32=False: the 16-bit gradients travel (half the bytes, in buckets that
    overlap backward) and are summed with 16-bit rounding, where the default sums fp32 masters."""
    cases = [ParallelConfig(dp=3, precision=precision, reduce_fp32=r) for r in (True, False)]
    ranks = minipar.launch(workers_dp.train_variants, 3, TINY, cases, STEPS, BATCH, timeout=120)
    fp32_sum, half_sum = ranks[0]
    assert half_sum.comm["all_reduce"] * 2 == pytest.approx(fp32_sum.comm["all_reduce"], rel=1e-4)
    ref = references[precision]
    for got in (fp32_sum, half_sum):
        assert max(abs(a - b) / b for a, b in zip(got.losses, ref.losses)) < 1e-4
        assert rel_diff(flat(got.state_dict), flat(ref.state_dict)) < 2e-3
    with pytest.raises(ValueError, match="reduce_fp32=False needs precision"):
        ParallelConfig(reduce_fp32=False)


def test_16_bit_data_parallelism_buckets_and_overlaps_like_fp32():
    """bf16 and fp16 under DP take dp_mode and bucket_mb as fp32 does (they were ignored: one
    all-reduce per master gradient after backward, and no timeline): the same buckets, launched
    during backward, in fp32 bytes."""
    cases = [ParallelConfig(dp=2, precision=p, **mode) for p in ("fp32", "bf16", "fp16")
             for mode in ({"bucket_mb": 0.1}, {"dp_mode": "naive"})]
    ranks = minipar.launch(workers_dp.train_variants, 2, TINY, cases, 2, 4, timeout=120)
    calls = [r.calls["all_reduce"] for r in ranks[0]]
    tensors = len(list(minipar.GPT(TINY).parameters()))
    assert calls[::2] == [calls[0]] * 3 and 2 < calls[0] < 2 * tensors  # buckets, every precision
    assert calls[1::2] == [2 * tensors] * 3  # naive: one a parameter
    for res in ranks[0][::2]:
        buckets = [s for s in res.spans if s[0].startswith("bucket")]
        backward = [s for s in res.spans if s[0] == "backward"]
        assert buckets and min(b[1] for b in buckets) < backward[-1][2]  # one began in backward
    # with gradient accumulation too: the last micro-batch's backward launches them (its hooks
    # once counted every micro-batch's gradients, and no bucket ever looked complete)
    acc = minipar.launch(workers_dp.train_variants, 2, TINY, [ParallelConfig(dp=2, microbatches=2,
                                                                              bucket_mb=0.1)],
                         1, 4, timeout=120)[0][0]
    backward = [s for s in acc.spans if s[0] == "backward"]
    assert backward[-2][2] < min(s[1] for s in acc.spans if s[0].startswith("bucket")) < \
        backward[-1][2]
