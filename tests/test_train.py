"""Single-process training: the reference every parallel layout is compared with."""
import math

import pytest
import torch
from reference import assert_same_training

import minipar
from minipar import GPTConfig, ParallelConfig

TINY = GPTConfig.preset("tiny")


def test_training_on_the_bundled_corpus_lowers_the_loss():
    res = minipar.train(TINY, steps=40, global_batch=16, lr=3e-3, data="shakespeare")
    assert abs(res.losses[0] - math.log(96)) < 0.15
    assert sum(res.losses[-5:]) / 5 < res.losses[0] - 1.0
    assert len(res.step_times) == 40 and res.tokens_per_s > 0 and 0 < res.mfu < 1


def test_same_seed_same_run_and_accumulation_equals_one_big_batch():
    a = minipar.train(TINY, steps=3, global_batch=8, return_state=True)
    b = minipar.train(TINY, steps=3, global_batch=8, return_state=True)
    c = minipar.train(TINY, ParallelConfig(microbatches=4), steps=3, global_batch=8, return_state=True)
    assert a.losses == b.losses
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert_same_training(c, a)


def test_memory_is_counted_by_category():
    res = minipar.train(TINY, steps=2, global_batch=4)
    mem = res.peak_memory[0]
    assert set(mem) == {"params", "grads", "optimizer", "activations", "comm"}
    assert mem["params"] == mem["grads"] == 4 * TINY.num_params      # fp32
    tensors = len(minipar.GPT(TINY).state_dict())
    assert mem["optimizer"] == 2 * 4 * TINY.num_params + 4 * tensors  # two moments + a step counter each
    assert mem["activations"] > 4 * 4 * TINY.seq_len * TINY.d_model * TINY.n_layer  # at least the layer inputs


def test_bf16_autocast_trains_close_to_fp32():
    fp32 = minipar.train(TINY, steps=5, global_batch=8, data="shakespeare")
    bf16 = minipar.train(TINY, ParallelConfig(precision="bf16"), steps=5, global_batch=8, data="shakespeare")
    assert max(abs(a - b) for a, b in zip(fp32.losses, bf16.losses)) < 0.05
    assert fp32.losses != bf16.losses


def test_a_run_not_watched_trains_and_counts_memory_the_same():
    """train_rank(watch=False), lesson 06's: no step_memory, the same losses and counted bytes (the
    activation meter alone) as a run whose second step a Tracker watched."""
    from minipar.train import train_layouts
    cfg = GPTConfig.preset("tiny")
    watched, not_watched = train_layouts([ParallelConfig(), dict(par=ParallelConfig(), watch=False)],
                                         cfg=cfg, steps=3, global_batch=4)
    assert watched.step_memory and not not_watched.step_memory
    assert not_watched.losses == watched.losses and not_watched.memory == watched.memory


def test_slowdown_emulates_a_slower_device_training_the_same():
    """Each forward and backward is followed by a sleep of 3x its time: a step about 4x as long
    (the optimizer step is not slowed), the same losses bit for bit. The fastest step of each run
    is compared, since a busy host only ever lengthens steps."""
    fast = minipar.train(TINY, steps=5, global_batch=8)
    slow = minipar.train(TINY, steps=5, global_batch=8, slowdown=4.0)
    assert slow.losses == fast.losses
    assert min(slow.step_times) > 2 * min(fast.step_times), (slow.step_times, fast.step_times)


@pytest.mark.parametrize("slowdown", [0.5, 0, float("nan"), float("inf"), True])
def test_a_bad_slowdown_fails_before_any_process(slowdown):
    with pytest.raises(ValueError, match="slowdown must be a number >= 1"):
        minipar.train(TINY, ParallelConfig(dp=2), steps=2, global_batch=8, slowdown=slowdown)
