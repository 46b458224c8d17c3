"""Lesson 02's exercise: the loss-scaler grader passes the reference answer and catches wrong ones;
and the lesson's measurements agree with minipar's predictions where they are exact."""
import pytest
import torch

from minipar import GPTConfig, memory
from minipar.lessons import demos_precision, exercises_precision, solutions
from minipar.precision import LossScaler


def keeps_counting_after_overflow(scale, good_steps, found_inf, *, growth, backoff,
                                  growth_interval):
    """Halves the scale on an overflow but does not start the count of good steps again."""
    if found_inf:
        return scale * backoff, good_steps
    good_steps += 1
    if good_steps >= growth_interval:
        return scale * growth, 0
    return scale, good_steps


def grows_one_step_late(scale, good_steps, found_inf, *, growth, backoff, growth_interval):
    """Compares before counting the step: grows on the step after the interval's last."""
    if found_inf:
        return scale * backoff, 0
    if good_steps == growth_interval:
        return scale * growth, 0
    return scale, good_steps + 1


def divides_by_backoff(scale, good_steps, found_inf, *, growth, backoff, growth_interval):
    """Reads "back off by a factor of 0.5" as a division: doubles the scale on an overflow."""
    if found_inf:
        return scale / backoff, 0
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth, 0
    return scale, good_steps


def test_the_reference_answer_passes():
    report = exercises_precision.check_loss_scaler(solutions.loss_scale_update)
    assert report.startswith("right: 12 sequences") and "[2000, 3]" in report


@pytest.mark.parametrize("wrong,message", [
    (keeps_counting_after_overflow, "overflow resets good_steps to 0"),
    (grows_one_step_late, "yours grew late or never"),
    (divides_by_backoff, "multiplied by backoff = 0.5"),
])
def test_wrong_loss_scalers_are_caught(wrong, message):
    with pytest.raises(AssertionError, match=message) as caught:
        exercises_precision.check_loss_scaler(wrong)
    assert "step" in str(caught.value) and "LossScaler gives" in str(caught.value)


def test_a_wrong_return_value_is_reported():
    with pytest.raises(AssertionError, match="must return a tuple"):
        exercises_precision.check_loss_scaler(lambda *args, **kwargs: None)


def test_the_sequences_reach_the_growth_interval():
    for interval in (3, 2000):
        runs = exercises_precision.sequences(interval)
        scaler = LossScaler(growth_interval=interval)
        for found_inf in runs["no overflow, two growth intervals and one step"]:
            scaler.update(found_inf)
        assert scaler.scale == 2.0**18 and scaler.good_steps == 1   # grew twice
        scaler = LossScaler(growth_interval=interval)
        for found_inf in runs["an overflow right after a growth"][:interval + 1]:
            scaler.update(found_inf)
        assert scaler.scale == 2.0**16 and scaler.good_steps == 0   # up, then straight back


def test_saved_bytes_equal_the_activation_formula():
    cfg = GPTConfig.preset("tiny").replace(n_layer=2, seq_len=16)
    for mode in ("fp32", "bf16"):
        measured = sum(demos_precision.saved_bytes(cfg, 2, mode).values())
        assert measured == sum(memory.activations(cfg, 2, memory.element_bytes(mode)).values())


def test_autocast_runs_matmuls_in_bf16_and_layer_norm_in_fp32():
    cfg = GPTConfig.preset("tiny").replace(n_layer=1, seq_len=8)
    counts = demos_precision.op_dtypes(cfg, 1, "amp")
    assert counts["addmm", "bfloat16"] > 0 and counts["native_layer_norm", "float32"] > 0
    assert counts["_to_copy", "bfloat16"] > 0   # the casts autocast inserts
    table = demos_precision.op_table({"amp": counts})
    assert "native_layer_norm" in table and "view" not in table.split()


def test_the_prediction_subtracts_what_each_kernel_saved():
    kernels = {"a": {torch.float32: 3.0, torch.bfloat16: 1.0},
               "b": {torch.float32: 1.0, torch.bfloat16: 4.0}}
    assert demos_precision.predict_step(10.0, kernels) == 10.0 - 2.0 + 3.0
