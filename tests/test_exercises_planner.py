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


def test_the_reference_layer_split_passes():
    assert "10 cases" in exercises_planner.check_layer_split(solutions.split_layers)


def even(n, seconds):  # as if all stages were alike
    return [n // len(seconds) + (i < n % len(seconds)) for i in range(len(seconds))]


def proportional_floor(n, seconds):  # in proportion to speed, rounded down, the rest to the last stage
    speed = [1 / s for s in seconds]
    layers = [max(1, int(n * v / sum(speed))) for v in speed]
    return layers[:-1] + [n - sum(layers[:-1])]


def proportional_rounded(n, seconds):  # in proportion to speed, rounded, the rest to the last stage
    speed = [1 / s for s in seconds]
    layers = [max(1, round(n * v / sum(speed))) for v in speed]
    return layers[:-1] + [n - sum(layers[:-1])]


def largest_remainder(n, seconds):  # in proportion to speed, the largest remainders rounded up
    raw = [n / s / sum(1 / x for x in seconds) for s in seconds]
    layers = [max(1, int(x)) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: layers[i] - raw[i])[:n - sum(layers)]:
        layers[i] += 1
    return layers


@pytest.mark.parametrize("split,message", [
    (even, r"split_layers\(8, \[1.0, 3.0\]\) = \[4, 4\]: its slowest stage takes 12, \[6, 2\] takes 6"),
    (proportional_floor, r"its slowest stage takes"),
    (proportional_rounded, r"split_layers\(9, \[3.0, 4.0, 1.0, 2.0\]\) = \[1, 1, 4, 3\]"),
    (largest_remainder, r"= \[2, 1, 4, 2\]: its slowest stage takes 6, \[1, 1, 5, 2\] takes 5"),
    (lambda n, seconds: None, "must return the layers of each stage"),
    (lambda n, seconds: [n] + [0] * (len(seconds) - 1), "at least one layer")])
def test_wrong_layer_splits_are_caught_with_their_cause(split, message):
    with pytest.raises(AssertionError, match=message):
        exercises_planner.check_layer_split(split)
