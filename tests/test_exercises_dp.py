"""Lesson 01's exercise: packing gradients into buckets. The reference answer passes the grader,
which checks it against the buckets a real GradBuckets forms; planted mistakes are each caught
with a message that names the rule they break."""
import pytest

from minipar.data_parallel import split
from minipar.lessons import exercises_dp, solutions


def test_the_reference_answer_passes():
    report = exercises_dp.check_pack(solutions.pack_buckets)
    assert report.startswith("pack correct") and "0 B -> 66" in report and "-> 1" in report


def test_the_grader_asks_what_split_does():
    """The real buckets are data_parallel.split's, and the caps reach every edge of its rule."""
    grads = exercises_dp.backward_grads("tiny")
    numels = [n for _, n, _ in grads][::-1]                  # model order
    names = [name for name, _, _ in grads][::-1]
    caps = exercises_dp.grader_caps(grads)
    for cap in caps.values():
        assert exercises_dp.real_buckets("tiny", cap) == \
            [[names[i] for i in b] for b in split(numels, cap, 4)]
    exact = exercises_dp.real_buckets("tiny", caps["filled exactly by the first four"])
    assert exact[0] == [name for name, _, _ in grads[:4]]   # a bucket may fill the cap exactly
    small = exercises_dp.real_buckets("tiny", caps["below the largest gradient"])
    assert ["blocks.3.mlp.proj.weight"] in small            # a gradient past the cap, alone


def forward_order(grads, bucket_bytes):
    """Packs in model order: the first bucket would wait for the last gradient backward makes."""
    return solutions.pack_buckets(grads[::-1], bucket_bytes)


def closes_when_full(grads, bucket_bytes):
    """`>=` for `>`: closes a bucket that the next gradient would fill exactly."""
    buckets, run, fill = [], [], 0
    for name, numel, nbytes in grads:
        if run and fill + numel * nbytes >= bucket_bytes:
            buckets, run, fill = buckets + [run], [], 0
        run, fill = run + [name], fill + numel * nbytes
    return buckets + [run]


def adds_then_checks(grads, bucket_bytes):
    """Adds the gradient first and closes the bucket once it is past the cap: the cap is exceeded."""
    buckets, run, fill = [], [], 0
    for name, numel, nbytes in grads:
        run, fill = run + [name], fill + numel * nbytes
        if fill > bucket_bytes:
            buckets, run, fill = buckets + [run], [], 0
    return buckets + [run] if run else buckets


def big_one_not_alone(grads, bucket_bytes):
    """Starts a fresh bucket for a gradient larger than the cap, but lets the next ones join it."""
    buckets, run, fill = [], [], 0
    for name, numel, nbytes in grads:
        size = numel * nbytes
        if run and (size > bucket_bytes or fill + size > bucket_bytes and fill <= bucket_bytes):
            buckets, run, fill = buckets + [run], [], 0
        run, fill = run + [name], fill + size
    return buckets + [run]


@pytest.mark.parametrize("wrong,message", [
    (forward_order, "model \\(forward\\) order"),
    (closes_when_full, "closed too early"),
    (adds_then_checks, "past the cap; start a new bucket"),
    (big_one_not_alone, "must be alone in its bucket")])
def test_wrong_packings_are_caught(wrong, message):
    with pytest.raises(AssertionError, match=message):
        exercises_dp.check_pack(wrong)


def test_a_wrong_shape_is_caught():
    with pytest.raises(AssertionError, match="a list of buckets"):
        exercises_dp.check_pack(lambda grads, cap: [name for name, _, _ in grads])
    with pytest.raises(AssertionError, match="exactly one bucket"):
        exercises_dp.check_pack(lambda grads, cap: [[name for name, _, _ in grads[1:]]])
