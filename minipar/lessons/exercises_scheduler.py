"""Lesson 10's exercise: a scheduling policy written by the learner, graded round by round against
the rule below, then run in the simulator beside the library's policies.

    check_srtf(policy)                          shortest remaining time first, on ROUNDS rounds
    simulate_with(policy, jobs, cluster, ...)   scheduler.simulate with a policy function

A policy maps a `policies.Round` (the jobs present as JobStates, the chips of each kind, the
throughput matrix) to an allocation {job name: (kind, count)}. Shortest remaining time first: a
job's remaining time is its remaining steps (`s.remaining`) at its best rate at its scale (on the
fastest kind for it, room or not); the jobs go in order of remaining time, least first (ties: in
arrival order, the order of view.jobs), and each takes its scale on the fastest kind with room
(`view.fastest(s, free, s.job.scale)`); a job that fits nowhere is passed over, and those behind it
may still run. It is preemptive: a running job with more time left than a newcomer gives way. The
loop is LAS's (policies.las) in another order; SRTF knows each job's remaining work, which a real
scheduler does not (Tiresias' point: least attained service needs no such knowledge). A reference
answer is `minipar.lessons.solutions.srtf`.
"""
from __future__ import annotations

import math
import random

from minipar.lessons import solutions
from minipar.scheduler import POLICIES, Job, policies, simulate

ROUNDS = 40        # rounds graded, seeded: 3 kinds of 1-6 chips, 4-9 jobs of scale 1, 2 or 4
KINDS = ("a", "b", "c")


def rounds(n: int = ROUNDS, seed: int = 0) -> list:
    """n random Rounds: each job's rates differ by kind (up to 12x, sometimes 0: it does not fit
    there) and from other jobs' (so that fewest steps left is not least time left)."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        caps = {k: rng.randint(1, 6) for k in KINDS}
        states, rates = [], {}
        for i in range(rng.randint(4, 9)):
            scale = rng.choice((1, 1, 2, 4))
            job = Job(f"j{i}", "m", 8, rng.randint(100, 5000), float(i), scale)
            rates[job.name] = {(k, scale): rng.choice((0.0, 1.0)) * rng.uniform(0.5, 6.0)
                               for k in KINDS}
            rates[job.name][(KINDS[i % 3], scale)] = rng.uniform(0.5, 6.0)   # it fits somewhere
            states.append(policies.JobState(job, done=rng.randint(0, job.steps - 1),
                                            attained=rng.uniform(0, 9000)))
        out.append(policies.Round(0.0, states, caps, rates))
    return out


def left(view, s) -> float:
    """s's remaining time: its remaining steps at its best rate at its scale, s."""
    best = max(view.rate(s, k, s.job.scale) for k in view.capacity)
    return s.remaining / best if best > 0 else math.inf


def _diagnose(view, got: dict, want: dict) -> str:
    """What the first job whose allocation differs from SRTF's got, and what SRTF gives it."""
    order = sorted(view.jobs, key=lambda s: left(view, s))   # stable: arrival breaks ties
    free = dict(view.capacity)
    for rank, s in enumerate(order):
        name, where, should = s.job.name, got.get(s.job.name), want.get(s.job.name)
        head = (f"job {name} ({s.remaining:g} steps left, {left(view, s):.0f} s at its best rate; "
                f"{rank} job(s) ahead of it; chips free at its turn {free})")
        if where != should:
            later = [o.job.name for o in order[rank + 1:] if should and
                     got.get(o.job.name, ("",))[0] == should[0]]
            head += f"; {', '.join(later)}, with more time left, took {should[0]}" if later else ""
            if should is None:
                return f"{head}: got {where}, but none of its kinds had room for its scale"
            if where is None:
                return f"{head}: got nothing, but {should} was free"
            if where[1] != s.job.scale:
                return f"{head}: got {where[1]} chips; SRTF gives each job its scale, {should}"
            return f"{head}: got {where}; the fastest kind with room was {should}"
        if should:
            free[should[0]] -= should[1]
    return f"allocation {got}, SRTF's {want}"


def check_srtf(policy) -> str:
    """Grade policy(Round) -> allocation on every round of `rounds()`: it must be a valid
    allocation (policies.check) and SRTF's (module docstring). A report, or AssertionError saying
    which job got what, and what SRTF gives it."""
    for i, view in enumerate(rounds()):
        got = policy(view)
        if not isinstance(got, dict):
            raise AssertionError(f"round {i}: the policy must return {{job name: (kind, count)}}, "
                                 f"got {type(got).__name__}")
        try:
            policies.check(view, got)
        except RuntimeError as e:
            raise AssertionError(f"round {i}: {e}") from None
        want = solutions.srtf(view)
        if got != want:
            raise AssertionError(f"round {i}: {_diagnose(view, got, want)}")
    view = rounds(1, seed=1)[0]
    return (f"shortest remaining time first on {ROUNDS} rounds; e.g. {len(view.jobs)} jobs on "
            f"{view.capacity}: {policy(view)}")


def simulate_with(policy, jobs, cluster, **options):
    """scheduler.simulate(jobs, cluster, policy, **options) for the learner's policy function,
    refusing a name the library's policies use (its results would read as theirs)."""
    name = policy.__name__
    if name in POLICIES:
        raise ValueError(f"scheduler.POLICIES already has a policy named {name!r}: rename yours")
    return simulate(jobs, cluster, policy, **options)
