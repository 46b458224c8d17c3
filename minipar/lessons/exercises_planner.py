"""Lesson 07's exercise: the planner's cost of a collective, written by the learner and graded
against `minipar.planner.gpu_time` (whose `all_reduce` and `gather_or_scatter` the planner calls for
every DP, ZeRO and TP collective it times). Lesson 09's: the layers of a pipeline split over stages
of different speeds, graded against `minipar.planner.partition.min_max`.

    check_collective_costs(all_reduce, gather_or_scatter)
    check_layer_split(split_layers)

Each function takes (nbytes, n, link), `link` a `planner.Link(bandwidth bytes/s, latency s a step)`,
and returns seconds: lesson 00's latency-bandwidth model of a ring. The grader tries them on every
case of CASES (one rank, two, odd counts, a whole cluster; NVLink and a NIC; nothing to send) and
on a wrong answer says which term is off: it reads the learner's latency term alone (nothing to
send) and bandwidth term alone (a link with no latency), and names the count of steps or the share
of the bytes that differs from the ring's.
"""
from __future__ import annotations

from minipar.planner import gpu_time
from minipar.planner.cluster import Link
from minipar.planner.partition import min_max

# bytes/s one way, s a step: of the order of the A100 presets' NVLink and NIC
NVLINK, NIC = Link(450e9, 3e-6), Link(25e9, 10e-6)
# one rank last: a wrong share of the bytes is named as such before the n = 1 rule
CASES = [(nbytes, n, link) for link in (NVLINK, NIC) for n in (2, 3, 5, 8, 64, 1)
         for nbytes in (0.0, 1e6, 4e9)]
PROBE = 1e9  # bytes: the size whose bandwidth term the grader reads


def _terms(fn, n: int, link: Link) -> tuple[float, float]:
    """(steps of latency, share of the bytes each rank sends) that `fn` charges for n ranks."""
    steps = fn(0.0, n, Link(link.bandwidth, 1.0))
    share = fn(PROBE, n, Link(link.bandwidth, 0.0)) * link.bandwidth / PROBE
    return steps, share


def _diagnose(name: str, fn, ref, nbytes: float, n: int, link: Link) -> str:
    got, want = fn(nbytes, n, link), ref(nbytes, n, link)
    (steps, share), (steps_ref, share_ref) = _terms(fn, n, link), _terms(ref, n, link)
    where = f"{name}({nbytes:g} bytes, n={n}, {link}) = {got:.4g} s, expected {want:.4g} s"
    if n == 1:
        return f"{where}: one rank has nobody to send to, the cost is 0"
    if abs(steps - steps_ref) > 1e-9:
        return f"{where}: it pays {steps:g} x the latency, the ring takes {steps_ref:g} steps"
    if abs(share - share_ref) > 1e-9:
        return (f"{where}: each rank sends {share:.4g} of the bytes, the ring sends "
                f"{share_ref:.4g} (= {'2' if name == 'all_reduce' else ''}(n-1)/n)")
    return where


def check_collective_costs(all_reduce, gather_or_scatter) -> str:
    """Grade the learner's two cost functions on every case; a report, or AssertionError."""
    pairs = (("all_reduce", all_reduce, gpu_time.all_reduce),
             ("gather_or_scatter", gather_or_scatter, gpu_time.gather_or_scatter))
    for name, fn, ref in pairs:
        for nbytes, n, link in CASES:
            got, want = fn(nbytes, n, link), ref(nbytes, n, link)
            if abs(got - want) > 1e-9 * max(abs(want), 1e-12):
                raise AssertionError(_diagnose(name, fn, ref, nbytes, n, link))
    ar = gpu_time.all_reduce(4e9, 8, NVLINK)
    return (f"both costs equal the planner's on {len(CASES)} cases each; e.g. 1B parameters' fp32 "
            f"gradients (4 GB) all-reduced by 8 GPUs over NVLink: {ar * 1e3:.1f} ms, over a NIC: "
            f"{gpu_time.all_reduce(4e9, 8, NIC) * 1e3:.0f} ms")


# (layers, each stage's seconds a layer): even, one slow stage, three kinds, a stage with one layer,
# as many stages as layers, speeds whose best splits tie, and two that rounding the proportional
# split misses (rounded: [1, 1, 4, 3] against [1, 1, 5, 2]; largest remainder: [2, 1, 4, 2])
SPLITS = [(8, (1.0, 1.0)), (8, (1.0, 3.0)), (8, (3.0, 1.0)), (7, (1.0, 2.0, 4.0)), (5, (1.0, 9.0)),
          (4, (2.0, 1.0, 1.0, 3.0)), (12, (1.0, 1.0, 2.0)), (80, (1.0, 1.31, 1.71)),
          (9, (3.0, 4.0, 1.0, 2.0)), (16, (1.31, 1.31, 1.0, 4.0))]


def _slowest(layers, seconds) -> float:
    return max(n * s for n, s in zip(layers, seconds))


def check_layer_split(split_layers) -> str:
    """Grade split_layers(n_layer, seconds) -> layers per stage (each >= 1, summing to n_layer) that
    make the slowest stage, its layers times its seconds a layer, as fast as any split can: on
    every case of SPLITS against min_max (the planner's split, the ends left out). Any optimal
    split passes (several may tie); a report, or AssertionError saying what is off."""
    for n, seconds in SPLITS:
        got, want = split_layers(n, list(seconds)), min_max(n, seconds, [0] * len(seconds),
                                                             [0] * len(seconds))
        where = f"split_layers({n}, {list(seconds)}) = {got}"
        if not isinstance(got, (list, tuple)):
            raise AssertionError(f"{where}: it must return the layers of each stage, a list")
        if len(got) != len(seconds) or sum(got) != n or min(got) < 1:
            raise AssertionError(f"{where}: it must give each of the {len(seconds)} stages at "
                                 f"least one layer, {n} in all")
        if _slowest(got, seconds) > _slowest(want, seconds) + 1e-12:
            raise AssertionError(f"{where}: its slowest stage takes {_slowest(got, seconds):g}, "
                                 f"{want} takes {_slowest(want, seconds):g}")
    n, seconds = max(SPLITS)   # the most layers: 80 on three stages
    k = len(seconds)
    even = [n // k + (i < n % k) for i in range(k)]
    return (f"as fast as the planner's split on {len(SPLITS)} cases; e.g. {n} layers on stages "
            f"{list(seconds)} s a layer: {split_layers(n, list(seconds))}, the slowest stage "
            f"{_slowest(split_layers(n, list(seconds)), seconds):g} against "
            f"{_slowest(even, seconds):g} split evenly")
