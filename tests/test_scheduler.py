"""The scheduler: traces, the simulator's arithmetic, each policy's invariants on hand-made traces,
the linear programs against a brute force, and Gavel's direction on a cluster of its shape."""
import collections
import itertools
import json
import random

import pytest

from minipar import scheduler
from minipar.data import bundled
from minipar.scheduler import policies
from minipar.scheduler.jobs import SCALE_P, SCALES, Job, elastic
from minipar.scheduler.policies import JobState, Round


def job(name, arrival, steps, scale=1, counts=(), model="m"):
    return Job(name, model, 8, steps, arrival, scale, counts)


def rates_for(jobs, table):
    """{name: {(kind, count): steps/s}} from table[model][(kind, count)]."""
    return {j.name: dict(table[j.model]) for j in jobs}


FLAT = {"m": {("a", 1): 1.0, ("a", 2): 2.0, ("b", 1): 0.5, ("b", 2): 1.0}}


def test_a_lone_job_takes_its_startup_and_its_steps_at_its_rate():
    jobs = [job("j", 0.0, 1000)]
    res = scheduler.simulate(jobs, {"a": 1, "b": 1}, "fifo", round_s=100,
                             restart=lambda j, where, first: 7.0, stop=lambda j, where: 2.0,
                             rates=rates_for(jobs, FLAT))
    # start-up, its steps on the faster kind (a), its last checkpoint and exit
    assert res.jct["j"] == pytest.approx(7 + 1000 / 1.0 + 2)
    assert res.segments == [("j", "a", 1, 0.0, pytest.approx(1009.0))]
    assert res.restarts["j"] == 0 and res.utilization == pytest.approx(1009 / 2018)


def test_fifo_keeps_arrival_order_and_never_preempts():
    jobs = [job(f"j{i}", 10.0 * i, 300 + 50 * i) for i in range(5)]
    res = scheduler.simulate(jobs, {"a": 1}, "fifo", round_s=60, restart=lambda *a: 0.0,
                             stop=lambda j, where: 0.0, rates=rates_for(jobs, FLAT))
    starts = {name: start for name, _, _, start, _ in res.segments}
    assert [starts[j.name] for j in jobs] == sorted(starts.values())
    assert len(res.segments) == len(jobs) and sum(res.restarts.values()) == 0


def test_fifo_lets_nobody_overtake_the_first_waiting_job():
    # j1 asks for 2 chips while j0 holds 1 of 2: the 1-chip j2 behind it must wait too
    jobs = [job("j0", 0.0, 500), job("j1", 1.0, 100, scale=2), job("j2", 2.0, 100)]
    res = scheduler.simulate(jobs, {"a": 2}, "fifo", round_s=50, restart=lambda *a: 0.0,
                             stop=lambda j, where: 0.0, rates=rates_for(jobs, FLAT))
    starts = {name: start for name, _, _, start, _ in res.segments}
    assert starts["j2"] >= starts["j1"] >= res.finish["j0"]


def test_las_serves_the_least_served_queue_first():
    # j0 runs alone past the one-chip-hour threshold; j1 arrives and takes the chip at once
    jobs = [job("j0", 0.0, 20000), job("j1", 5000.0, 600)]
    res = scheduler.simulate(jobs, {"a": 1}, "las", round_s=100, restart=lambda *a: 0.0,
                             stop=lambda j, where: 0.0, rates=rates_for(jobs, FLAT))
    j1 = [s for s in res.segments if s[0] == "j1"]
    assert j1[0][3] == 5000.0 and res.finish["j1"] == 5600.0   # arrived at a round's start
    assert res.restarts["j0"] == 1 and res.finish["j0"] == 20600.0
    # below the threshold both are in the first queue: arrival order, no preemption
    jobs = [job("j0", 0.0, 3000), job("j1", 100.0, 600)]
    res = scheduler.simulate(jobs, {"a": 1}, "las", round_s=100, restart=lambda *a: 0.0,
                             stop=lambda j, where: 0.0, rates=rates_for(jobs, FLAT))
    assert res.finish["j0"] == 3000.0 and res.restarts["j0"] == 0


def test_a_restart_costs_what_restart_and_stop_say_and_is_counted():
    jobs = [job("j0", 0.0, 20000), job("j1", 5000.0, 600)]
    res = scheduler.simulate(jobs, {"a": 1}, "las", round_s=100,
                             restart=lambda j, where, first: 3.0 if first else 40.0,
                             stop=lambda j, where: 5.0, rates=rates_for(jobs, FLAT))
    # j0: 4997 steps by 5000 s (3 s of start-up), then stopped: it holds the chip 5 s more while it
    # saves, so j1 starts 5 s late, runs 3 + 600 s (+ 5 s of final save), and its chip idles until
    # the round at 5700 s, when j0 pays its 40 s restart (its save long done), does the other
    # 15003 steps and saves
    assert res.finish["j1"] == 5608.0 + 5   # and its own last save
    assert res.finish["j0"] == pytest.approx(5700 + 40 + 20000 - (5000 - 3) + 5)
    assert res.restarts == {"j0": 1, "j1": 0}


def random_round(rng, kinds=("a", "b", "c"), n_jobs=7, n_types=None):
    """A Round of random jobs (of n_types types, each with its scale and rates: jobs of one type
    share a class of the linear programs), history and capacity."""
    caps = {k: rng.randint(1, 6) for k in kinds}
    caps[kinds[0]] = max(caps[kinds[0]], 4)   # room for the largest scale where every job runs
    types = {}
    for t in range(n_types or n_jobs):
        scale = rng.choice((1, 2, 4))
        table = {(k, n): (rng.uniform(0.2, 3.0) * n ** 0.9 if rng.random() > 0.15 else 0.0)
                 for k in kinds for n in elastic(scale)}
        table[(kinds[0], scale)] = 1.0   # every job runs somewhere at its scale
        types[f"m{t}"] = scale, table
    states, rates = [], {}
    for i in range(n_jobs):
        model = f"m{i % len(types)}"
        scale, table = types[model]
        j = job(f"j{i}", float(i), 100, scale=scale, counts=elastic(scale), model=model)
        rates[j.name] = dict(table)
        s = JobState(j, attained=rng.uniform(0, 8000), age=rng.randint(0, 5))
        s.received = {(k, scale): rng.randint(0, s.age) for k in kinds if rng.random() < 0.5}
        states.append(s)
    return Round(0.0, states, caps, rates)


@pytest.mark.parametrize("policy", sorted(scheduler.POLICIES))
def test_no_policy_over_allocates_and_the_preemptive_ones_conserve_work(policy):
    rng = random.Random(3)
    for _ in range(30):
        view = random_round(rng)
        alloc = scheduler.POLICIES[policy](view)
        policies.check(view, alloc)   # raises on over-allocation
        if policy == "fifo":
            continue
        free = dict(view.capacity)
        for kind, count in alloc.values():
            free[kind] -= count
        for s in view.jobs:
            if s.job.name not in alloc:
                assert view.fastest(s, free, s.job.scale) is None, (policy, s.job.name)


def test_check_refuses_an_over_allocation():
    view = random_round(random.Random(0))
    name = view.jobs[0].job.name
    with pytest.raises(RuntimeError, match="over-allocated|cannot run"):
        policies.check(view, {s.job.name: ("a", s.job.scale) for s in view.jobs} |
                       {name: ("a", 99)})


def normalised(view, fractions):
    """Each job's throughput over its equal-share rate (the max-min objective, said again here
    from the docstring rather than taken from the code under test)."""
    chips = sum(view.capacity.values())
    share = min(1.0, chips / sum(s.job.scale for s in view.jobs))
    out = {}
    for s in view.jobs:
        fit = [view.rate(s, k, s.job.scale) for k in view.capacity
               if view.rate(s, k, s.job.scale) > 0]
        got = sum(view.rate(s, k, n) * x for (k, n), x in fractions[s.job.name].items())
        out[s.job.name] = got / (share * sum(fit) / len(fit))
    return out


def feasible(view, fractions):
    used = collections.Counter()
    for s in view.jobs:
        assert sum(fractions[s.job.name].values()) <= 1 + 1e-7
        for (k, n), x in fractions[s.job.name].items():
            assert x >= -1e-9
            used[k] += n * x
    return all(used[k] <= view.capacity[k] + 1e-7 for k in view.capacity)


@pytest.mark.parametrize("seed", range(4))
def test_the_max_min_program_matches_a_brute_force(seed):
    rng = random.Random(seed)
    view = random_round(rng, kinds=("a", "b"), n_jobs=2)
    for s in view.jobs:   # distinct types: one job a class
        s.job = Job(s.job.name, f"t{s.job.name}", 8, 100, 0.0, s.job.scale)
    best, grid = 0.0, [i / 20 for i in range(21)]
    configs = [(s, [(k, s.job.scale) for k in view.capacity
                    if view.rate(s, k, s.job.scale) > 0]) for s in view.jobs]
    for xs in itertools.product(grid, repeat=sum(len(c) for _, c in configs)):
        it, fr = iter(xs), {}
        for s, cfgs in configs:
            fr[s.job.name] = {cfg: next(it) for cfg in cfgs}
        if all(sum(f.values()) <= 1 for f in fr.values()) and feasible(view, fr):
            best = max(best, min(normalised(view, fr).values()))
    lp = policies._solve(view, elastic=False, objective="max-min")
    assert feasible(view, lp)
    assert min(normalised(view, lp).values()) >= best - 1e-6   # the grid is coarser than the LP
    assert min(normalised(view, lp).values()) <= best * 1.15 + 1e-6  # ... but not far off
    # water-filling keeps the optimum and adds throughput
    filled = policies._solve(view, elastic=False, objective="sum", fairness=1.0)
    assert min(normalised(view, filled).values()) == pytest.approx(
        min(normalised(view, lp).values()), rel=1e-5)


def test_minipar_keeps_every_job_within_its_fairness_bound():
    rng = random.Random(5)
    for i in range(10):
        view = random_round(rng, n_jobs=9, n_types=3 + i % 3)   # classes of several jobs
        z = min(normalised(view, policies._solve(view, elastic=True, objective="max-min")).values())
        fr = policies._solve(view, elastic=True, objective="sum", fairness=0.8)
        assert feasible(view, fr)
        assert min(normalised(view, fr).values()) >= 0.8 * z * (1 - 1e-5)


def test_the_generator_draws_gavels_distribution():
    jobs = scheduler.generate(4000, jobs_per_hour=30, seed=1, rate=lambda kind, dev, n: 1.0)
    counts = collections.Counter(j.scale for j in jobs)
    for scale, p in zip(SCALES, SCALE_P):
        assert counts[scale] / len(jobs) == pytest.approx(p, abs=0.025)
    long = sum(j.steps > 60 * 1000 for j in jobs) / len(jobs)   # 10^U(3,4) minutes: 20%
    assert long == pytest.approx(0.2, abs=0.025)
    assert all(60 * 10 ** 1.5 - 1 <= j.steps <= 60 * 10 ** 4 + 1 for j in jobs)
    gaps = [b.arrival - a.arrival for a, b in zip(jobs, jobs[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(120.0, rel=0.06)
    assert scheduler.generate(5, 30, seed=1, rate=lambda *a: 1.0) == jobs[:5]   # seeded


@pytest.mark.parametrize("name,n", [("pai_sample.csv", 20), ("philly_sample.json", 17)])
def test_the_readers_take_the_public_formats(name, n):
    jobs = scheduler.read_trace(bundled("data") / "traces" / name, rate=lambda *a: 2.0)
    assert len(jobs) == n and jobs[0].arrival == 0.0
    assert [j.arrival for j in jobs] == sorted(j.arrival for j in jobs)
    assert all(j.scale in (1, 2, 4, 8) and j.steps >= 1 for j in jobs)


def test_the_matrix_exports_as_gavels_json():
    jobs = [Job("a", "gpt2-small", 64, 10, 0.0, 2, (1, 2))]
    matrix = {"a": {("dgx-h100", 1): 3.0, ("dgx-h100", 2): 5.5}}
    out = json.loads(scheduler.to_gavel(jobs, matrix))
    assert out == {"dgx-h100": {"('gpt2-small (batch size 64)', 1)": {"null": 3.0},
                                "('gpt2-small (batch size 64)', 2)": {"null": 5.5}}}


def test_the_planned_matrix_holds_the_layouts_and_zero_where_nothing_fits():
    kind = ("gpt2-xl", 32)
    assert scheduler.rate(kind, "tpu-v5e", 1) == 0.0   # 1.5B params with Adam: over 16 GiB
    one, two = scheduler.layout(kind, "dgx-h100", 1), scheduler.layout(kind, "dgx-h100", 2)
    assert one.par.world == 1 and two.par.world == 2
    assert scheduler.rate(kind, "dgx-h100", 2) > scheduler.rate(kind, "dgx-h100", 1) > \
        scheduler.rate(kind, "dgx-a100-80g", 1) > 0


def test_gavels_direction_heterogeneity_aware_max_min_beats_the_blind_one():
    cluster = {"dgx-h100": 36, "dgx-a100-80g": 36, "tpu-v5e": 36}   # Gavel's 36 + 36 + 36
    for per_hour in (2, 4, 6):
        jobs = scheduler.generate(120, jobs_per_hour=per_hour, seed=1)
        matrix = scheduler.throughput_matrix(jobs, cluster)
        aware, blind = (scheduler.simulate(jobs, cluster, p, rates=matrix).avg_jct
                        for p in ("max-min", "max-min-blind"))
        assert aware < blind, per_hour


def test_the_schedule_command_prints_each_policys_metrics(capsys, tmp_path):
    from minipar.__main__ import main
    main(["schedule", "--jobs", "6", "--jobs-per-hour", "10", "--cluster", "dgx-h100:8",
          "--policy", "fifo,minipar", "--gavel-json", str(tmp_path / "t.json")])
    out = capsys.readouterr()[0].splitlines()
    assert out[-3].split()[:3] == ["policy", "avg", "JCT"]
    assert [line.split()[0] for line in out[-2:]] == ["fifo", "minipar"]
    assert "dgx-h100" in json.loads((tmp_path / "t.json").read_text())


@pytest.mark.parametrize("args,message", [
    (["--cluster", "h100"], "kind:chips pairs"), (["--cluster", "k80:4"], "unknown kind 'k80'"),
    (["--policy", "srtf"], "unknown policy 'srtf'"), (["--trace", "nowhere.csv"], "no such file"),
    (["--fairness", "2"], "--fairness must be in"), (["--round-s", "nan"], "--round-s must be"),
    (["--gavel-json", "/proc/no/t.json"], "cannot be written")])
def test_a_bad_schedule_request_is_one_line_before_any_planning(args, message):
    from minipar.__main__ import main
    with pytest.raises(SystemExit, match=f"^error: .*{message}"):
        main(["schedule", *args])


def test_rounds_shorter_than_a_restart_still_finish():
    # Gavel's rounds move jobs between configurations; a job still paying its start keeps its chips
    # (moved every round, a restart of 30 s in rounds of 10 s would never end). They still churn:
    # two jobs sharing one chip fairly trade it dozens of times, each trade 35 s of restart
    jobs = [job("j0", 0.0, 300), job("j1", 0.0, 300)]
    for policy in ("max-min", "max-min-blind", "max-throughput", "minipar"):
        res = scheduler.simulate(jobs, {"a": 1}, policy, round_s=10,
                                 restart=lambda *a: 30.0, stop=lambda *a: 5.0,
                                 rates=rates_for(jobs, FLAT))
        assert len(res.jct) == 2, policy


def test_a_trace_of_big_jobs_and_a_file_of_another_form():
    assert elastic(32) == (1, 2, 4, 8, 16, 32, 64) and elastic(1) == (1, 2)
    jobs = scheduler.read_trace(bundled("data") / "traces" / "pai_sample.csv",
                                rate=lambda *a: 2.0, limit=3)
    assert len(jobs) == 3


@pytest.mark.parametrize("text,suffix,message", [
    ("a,b\n1,2\n", ".csv", "not a PAI task table .*no column"),
    ('{"jobs": []}', ".json", "not a Philly job log"), ("{", ".json", "not a Philly job log")])
def test_a_trace_file_of_another_form_is_one_clear_error(tmp_path, text, suffix, message):
    path = tmp_path / f"trace{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        scheduler.read_trace(path, rate=lambda *a: 1.0)


def test_a_job_larger_than_every_kind_or_a_bad_round_is_refused_before_any_round():
    jobs = [job("j", 0.0, 10, scale=2)]
    with pytest.raises(ValueError, match="at the 2 chips it asks for"):
        scheduler.simulate(jobs, {"a": 1}, "fifo", rates={"j": {("a", 2): 1.0}})
    with pytest.raises(ValueError, match="finite"):
        scheduler.simulate(jobs, {"a": 2}, "fifo", round_s=float("inf"),
                           rates={"j": {("a", 2): 1.0}})


def shrink_round(a_owes: bool, b_first: bool = False) -> Round:
    """A (elastic: 1 or 2 chips) held both chips of "a" last round; B (1 chip) has just arrived;
    two chips run A exactly twice as fast as one. b_first: B's class first in the programs."""
    jobs = [job("A", 0.0, 100, counts=(1, 2)), job("B", 1.0, 100)]
    a, b = JobState(jobs[0], current=("a", 2), received={("a", 2): 1}, age=1), JobState(jobs[1])
    a.owed = 5.0 if a_owes else 0.0
    return Round(1.0, [b, a] if b_first else [a, b], {"a": 2},
                 {"A": {("a", 1): 1.0, ("a", 2): 2.0}, "B": {("a", 1): 1.0}})


@pytest.mark.parametrize("b_first", [False, True])
def test_at_linear_scaling_the_elastic_job_shrinks_rather_than_rotate(b_first):
    # A on 2 chips half the rounds is as much throughput as on 1 chip every round: of the two
    # splits, minipar's takes the one that pauses nobody (rotating would restart both every round;
    # without the tie-break the solver's pick follows the order of the columns: the fractions catch
    # it, this round's allocation alone would not, the fill giving A the free chip)
    view = shrink_round(False, b_first)
    fractions = policies._solve(view, elastic=True, objective="sum", fairness=0.8)
    assert fractions["A"][("a", 1)] == pytest.approx(1.0) and fractions["A"][("a", 2)] < 1e-6
    assert policies.minipar(view) == {"A": ("a", 1), "B": ("a", 1)}


def test_a_job_still_paying_its_start_keeps_its_chips_whatever_its_fractions():
    # the fractions give A no round on 2 chips, but it is still starting there: it keeps them, and
    # B waits (a real process cannot stop before its first step)
    assert policies.minipar(shrink_round(True)) == {"A": ("a", 2)}


def test_step_times_on_more_cores_are_held_to_linear_scaling():
    from minipar.scheduler.runner import _held_to_linear
    t = {("m", "core", 1): 1.0, ("m", "core", 2): 0.4, ("m", "core", 4): 0.3,
         ("n", "core", 2): 0.1}
    assert _held_to_linear(t) == {("m", "core", 1): 1.0, ("m", "core", 2): 0.5,
                                  ("m", "core", 4): 0.3, ("n", "core", 2): 0.1}
