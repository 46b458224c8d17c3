"""Lesson 07's exercise: the reference answer passes, and each usual slip is caught with its cause."""
import pytest

from minipar.lessons import exercises_planner, solutions


def test_the_reference_costs_pass():
    report = exercises_planner.check_collective_costs(solutions.ring_all_reduce_cost, solutions.ring_gather_cost)
    assert "36 cases" in report


def steps_once(nbytes, n, link):  # the all-reduce's latency paid n-1 times, as a reduce-scatter's
    return (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def every_byte(nbytes, n, link):  # each rank sends the whole tensor
    return 0.0 if n == 1 else (n - 1) * link.latency + nbytes / link.bandwidth


def one_rank_pays(nbytes, n, link):  # a latency even alone: 1 step minimum
    return max(1, n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


@pytest.mark.parametrize("all_reduce,gather,message", [
    (steps_once, solutions.ring_gather_cost, r"n=2, .* it pays 1 x the latency, the ring takes 2 steps"),
    (solutions.ring_all_reduce_cost, every_byte, "each rank sends 1 of the bytes, the ring sends 0.5"),
    (solutions.ring_all_reduce_cost, one_rank_pays, "one rank has nobody to send to")])
def test_wrong_costs_are_caught_with_their_cause(all_reduce, gather, message):
    with pytest.raises(AssertionError, match=message):
        exercises_planner.check_collective_costs(all_reduce, gather)
