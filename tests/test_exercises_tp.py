"""Lessons 04 and 06's exercises: each grader passes the reference answer and catches wrong ones."""
import pytest

from minipar.lessons import exercises_tp, solutions
from minipar.model import GPTConfig


def forgets_the_sum(x_shard, weight, bias, dist):
    """Right block, no all-reduce: returns this rank's term only."""
    rank, t = dist.get_rank(), dist.get_world_size()
    return x_shard @ weight.tensor_split(t, dim=1)[rank].T + bias


def bias_on_every_rank(x_shard, weight, bias, dist):
    """Adds the bias to each rank's term, then sums: the bias t times."""
    rank, t = dist.get_rank(), dist.get_world_size()
    y = x_shard @ weight.tensor_split(t, dim=1)[rank].T + bias
    dist.all_reduce(y)
    return y


def cuts_the_wrong_dimension(x_shard, weight, bias, dist):
    """Takes the weight's rows (output features), a column-parallel cut."""
    rank, t = dist.get_rank(), dist.get_world_size()
    y = x_shard @ weight.tensor_split(t, dim=0)[rank].T
    dist.all_reduce(y)
    return y + bias


def chunks_unevenly(x_shard, weight, bias, dist):
    """torch.chunk, not tensor_split: 10 features on 3 ranks become 4, 4, 2, not 4, 3, 3."""
    rank, t = dist.get_rank(), dist.get_world_size()
    y = x_shard @ weight.chunk(t, dim=1)[rank].T
    dist.all_reduce(y)
    return y + bias


def dp_innermost(rank, dp, tp, pp):
    """Data parallelism innermost: consecutive ranks are replicas."""
    return rank % dp, (rank // dp) % tp, rank // (dp * tp)


def forgets_dp(rank, dp, tp, pp):
    """tp innermost, but the pipeline stage taken as rank // tp, as if dp were 1."""
    return (rank // tp) % dp, rank % tp, (rank // tp) % pp


def test_the_row_parallel_answer_passes():
    report = exercises_tp.check_row_parallel(solutions.row_parallel)
    assert "[4, 3, 3]" in report and "RowParallelLinear" in report


@pytest.mark.parametrize("wrong,message", [(forgets_the_sum, "the sum over ranks is missing"),
                                           (bias_on_every_rank, "holds the bias 3 times"),
                                           (cuts_the_wrong_dimension, "tensor_split(t, dim=1)"),
                                           (chunks_unevenly, "tensor_split(t, dim=1)")])
def test_wrong_row_parallels_are_caught(wrong, message):
    with pytest.raises(AssertionError) as caught:
        exercises_tp.check_row_parallel(wrong, cases=((3, 10, 7),))
    assert message in str(caught.value), str(caught.value)


def test_two_all_reduces_are_caught():
    def twice(x_shard, weight, bias, dist):
        y = solutions.row_parallel(x_shard, weight, bias, dist) - bias
        dist.all_reduce(y.zero_())
        return solutions.row_parallel(x_shard, weight, bias, dist)
    with pytest.raises(AssertionError, match="needs exactly one"):
        exercises_tp.check_row_parallel(twice, cases=((2, 8, 6),))


def test_the_coords_answer_passes():
    assert "8 shapes" in exercises_tp.check_coords(solutions.coords)


@pytest.mark.parametrize("wrong,hint", [(dp_innermost, "are one TP group"), (forgets_dp, "is off")])
def test_wrong_coords_are_caught(wrong, hint):
    with pytest.raises(AssertionError, match="tp innermost") as caught:
        exercises_tp.check_coords(wrong)
    assert hint in str(caught.value), str(caught.value)


def test_a_tp_block_calls_what_the_lesson_says():
    cfg = GPTConfig.preset("tiny")
    assert exercises_tp.block_calls(cfg, 2, False) == {"forward": {"all_reduce": 2},
                                                       "backward": {"all_reduce": 2}}
    assert exercises_tp.block_calls(cfg, 4, True) == {
        "forward": {"all_gather": 2, "reduce_scatter": 2},
        "backward": {"all_gather": 4, "reduce_scatter": 2}}
