"""Lesson 10's exercise: the reference SRTF passes, each usual slip is caught with its cause, and a
policy function runs in the simulator (and leaves scheduler.POLICIES as it found it)."""
import pytest

from minipar import scheduler
from minipar.lessons import exercises_scheduler, solutions


def test_the_reference_srtf_passes():
    assert "on 40 rounds" in exercises_scheduler.check_srtf(solutions.srtf)


def ordered_by(key, room=True, strict=False, count=None, kind_of=None):
    """LAS's loop over the jobs in `key` order, with one thing changed: no room check, a strict
    order (stop at the first that does not fit), another count, another choice of kind."""
    def policy(view):
        free, alloc = dict(view.capacity), {}
        for s in sorted(view.jobs, key=lambda s: key(view, s)):
            n = count or s.job.scale
            kind = kind_of(view, s, free, n) if kind_of else \
                view.fastest(s, free if room else dict(view.capacity), n)
            if kind is None:
                if strict:
                    break
                continue
            alloc[s.job.name] = (kind, n)
            free[kind] -= n
        return alloc
    return policy


srtf_order = exercises_scheduler.left


def slowest(view, s, free, n):   # the slowest kind with room that runs it
    fits = [k for k in view.capacity if free[k] >= n and view.rate(s, k, n) > 0]
    return min(fits, key=lambda k: view.rate(s, k, n), default=None)


@pytest.mark.parametrize("policy,message", [
    (ordered_by(lambda view, s: s.remaining),   # fewest steps, not least time, first
     r"job j\d \(\d+ steps left, \d+ s at its best rate.* with more time left, took"),
    (ordered_by(lambda view, s: s.attained), "with more time left, took"),   # LAS, one queue
    (ordered_by(lambda view, s: -srtf_order(view, s)), "with more time left, took"),  # longest
    (ordered_by(srtf_order, room=False), "over-allocated"),
    (ordered_by(srtf_order, strict=True), r"got nothing, but \('\w', \d\) was free"),
    (ordered_by(srtf_order, kind_of=slowest), "the fastest kind with room was"),
    (ordered_by(srtf_order, count=1), "SRTF gives each job its scale|had room|got nothing"),
    (lambda view: [], "must return {job name: \\(kind, count\\)}")])
def test_wrong_policies_are_caught_with_their_cause(policy, message):
    with pytest.raises(AssertionError, match=message):
        exercises_scheduler.check_srtf(policy)


def test_a_policy_function_runs_in_the_simulator_and_is_unregistered_after():
    jobs = [scheduler.Job("long", "m", 8, 1000, 0.0, 1), scheduler.Job("short", "m", 8, 100, 50.0, 1)]
    rates = {j.name: {("a", 1): 1.0} for j in jobs}
    before = dict(scheduler.POLICIES)
    res = exercises_scheduler.simulate_with(solutions.srtf, jobs, {"a": 1}, round_s=100,
                                            rates=rates, restart=lambda *a: 0.0,
                                            stop=lambda *a: 0.0)
    # the short job preempts the long one at the round after it arrives (100 s) and ends at 200 s
    assert res.finish["short"] == 200.0 and res.restarts == {"long": 1, "short": 0}
    assert res.policy == "srtf" and scheduler.POLICIES == before
    with pytest.raises(ValueError, match="already has a policy named 'las'"):
        exercises_scheduler.simulate_with(scheduler.POLICIES["las"], jobs, {"a": 1}, rates=rates)
