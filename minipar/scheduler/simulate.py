"""A discrete-event simulator of many training jobs on one shared cluster, in scheduling rounds.

Time moves in rounds of `round_s` (Gavel's 360 s). At each round's start the jobs that have arrived
are shown to the policy (policies.py), which returns an allocation, {job name: (kind, count)}; the
simulator checks it (no kind over its chips, counts the job accepts, a rate above 0) and runs the
round: each allocated job progresses at its rate there (the throughput matrix, steps/s). A job whose
allocation differs from its last round's was preempted or moved: its chips stay held while it saves
its checkpoint (`stop`; a finishing job's last checkpoint and exit take as long), and when it starts
again it pays a restart (processes started, the checkpoint loaded; the first start pays the start-up
alone), owed across rounds if longer than one; a job that starts on chips another job is leaving
waits for that one's save too. A job that finishes mid-round leaves its chips idle until the next
round, as in Gavel.

Metrics (`Result`): each job's completion time (JCT, arrival to finish), their mean and 99th
percentile, the makespan (first arrival to last finish), utilisation (chip-seconds allocated over
the cluster's chip-seconds up to the makespan) and finish-time fairness (Themis, Mahajan et al. NSDI
2020): rho = JCT / (the job's time alone on its best kind at its scale x the cluster's contention
while it was there, max(1, chips asked by the jobs present / chips)); rho <= 1 means the job did at
least as well as an equal share of a contended cluster would give.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from minipar.scheduler import policies
from minipar.scheduler.throughput import STARTUP_S, capacity, checkpoint_seconds, throughput_matrix


@dataclass
class Result:
    jct: dict                       # {job name: seconds from arrival to completion}
    finish: dict                    # {job name: completion time, s from the trace's start}
    segments: list                  # (job, kind, count, start s, end s): who held what (a Gantt)
    restarts: dict                  # {job name: restarts paid (preemptions, moves, re-layouts)}
    ftf: dict                       # {job name: finish-time fairness rho}
    utilization: float              # chip-seconds allocated / the cluster's, up to the makespan
    makespan: float                 # first arrival to last completion, s
    rounds: int = 0
    policy: str = ""
    capacity: dict = field(default_factory=dict)
    rates: dict = field(default_factory=dict, repr=False)   # the throughput matrix used

    @property
    def avg_jct(self) -> float:
        return sum(self.jct.values()) / len(self.jct)

    @property
    def p99_jct(self) -> float:
        """The 99th percentile JCT (nearest rank)."""
        ranked = sorted(self.jct.values())
        return ranked[max(0, math.ceil(0.99 * len(ranked)) - 1)]

    @property
    def worst_ftf(self) -> float:
        return max(self.ftf.values())

    def row(self) -> dict:
        """The metrics table's row (hours)."""
        return {"policy": self.policy, "avg JCT h": self.avg_jct / 3600,
                "p99 JCT h": self.p99_jct / 3600, "makespan h": self.makespan / 3600,
                "utilization": self.utilization, "worst rho": self.worst_ftf,
                "restarts": sum(self.restarts.values())}


def simulate(jobs, cluster, policy: str = "fifo", round_s: float = 360.0, rates=None,
             restart=None, stop=None, decide=None, **options) -> Result:
    """Run `jobs` on `cluster` ({kind: chips} or a Cluster) under `policy` (a name of
    policies.POLICIES, or a function of a policies.Round to an allocation; its options, e.g.
    fairness= for "minipar"). rates: the throughput matrix (default: the planner's,
    throughput_matrix); restart(job, (kind, count), first) -> seconds a start on those chips costs,
    `first` for the job's first; stop(job, (kind, count)) -> seconds a stopped or moved job still
    holds those chips (its checkpoint written, its processes gone): whoever starts on that kind in
    that round waits for them, and so does the job itself (its load follows its save). Defaults:
    gpu_restart, gpu_stop. decide: the matrix the policy sees, if not `rates` (a real run replayed:
    jobs progress at the rates measured, the policy decides on the planner's, as it did)."""
    caps = capacity(cluster)
    jobs = sorted(jobs, key=lambda j: j.arrival)
    rates = rates if rates is not None else throughput_matrix(jobs, caps)
    pick, policy = _check(jobs, caps, rates, policy, round_s)
    restart, stop = restart or gpu_restart, stop or gpu_stop
    chips = sum(caps.values())
    pending, active = collections.deque(jobs), []
    out = Result({}, {}, [], {j.name: 0 for j in jobs}, {}, 0.0, 0.0, policy=policy,
                 capacity=caps, rates=rates)
    held, t, idle = 0.0, 0.0, 0   # idle: rounds in a row in which no job was given a chip
    most = _most_rounds(jobs, rates, round_s)
    while pending or active:
        while pending and pending[0].arrival <= t:
            active.append(policies.JobState(pending.popleft()))
        if not active:
            t = math.ceil(pending[0].arrival / round_s) * round_s
            continue
        view = policies.Round(t, active, caps, decide or rates, options)
        alloc = pick(view)
        policies.check(view, alloc)
        out.rounds, idle = out.rounds + 1, 0 if alloc else idle + 1
        if idle > 10_000 or out.rounds > most:   # a policy that never runs what waits, or moves
            # jobs faster than they restart, would loop forever
            raise RuntimeError(f"{policy}: {len(active)} jobs unfinished after {out.rounds} rounds "
                               f"({idle} in a row running none)")
        asked = max(1.0, sum(s.job.scale for s in active) / chips)
        leaving, stopping = {}, {}   # kind: the longest stop on it; job: its own stop
        for s in active:
            if s.current is not None and alloc.get(s.job.name) != s.current:
                stopping[s.job.name] = stop(s.job, s.current)
                kind = s.current[0]
                leaving[kind] = max(leaving.get(kind, 0.0), stopping[s.job.name])
        for s in active:
            s.contention += asked
            where = alloc.get(s.job.name)
            start = s.assign(where)
            if start:
                s.owed = max(leaving.get(where[0], 0.0), stopping.get(s.job.name, 0.0)) + \
                    restart(s.job, where, start == "first")
                out.restarts[s.job.name] += start == "restart"
            if where is not None:
                held += where[1] * _play(s, rates[s.job.name][where], t, round_s,
                                         stop(s.job, where), out)
        active = [s for s in active if s.job.name not in out.finish]
        t += round_s
    out.makespan = max(out.finish.values()) - jobs[0].arrival
    out.utilization = held / (chips * out.makespan)
    out.segments = _merged(out.segments)
    return out


def _most_rounds(jobs: list, rates: dict, round_s: float) -> float:
    """Rounds enough for 100 times the trace run one job after another, each at its slowest."""
    serial = sum(j.steps / min(r for r in rates[j.name].values() if r > 0) for j in jobs)
    return 1000 + 100 * (jobs[-1].arrival + serial) / round_s


def _check(jobs: list, caps: dict, rates: dict, policy, round_s: float) -> tuple:
    """ValueError for what cannot be simulated: before any round runs. Returns (the policy's
    function, its name)."""
    if not callable(policy) and policy not in policies.POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(policies.POLICIES)}")
    if not 0 < round_s < math.inf:
        raise ValueError(f"round_s must be positive, finite seconds, got {round_s!r}")
    if len({j.name for j in jobs}) != len(jobs) or not jobs:
        raise ValueError("jobs must be a non-empty list with distinct names")
    for job in jobs:
        if not any(rates[job.name].get((k, job.scale), 0) > 0 and job.scale <= caps[k]
                   for k in caps):
            raise ValueError(f"job {job.name} ({job.model}, batch {job.global_batch}) fits on "
                             f"no kind of {sorted(caps)} at the {job.scale} chips it asks for")
    return (policy, policy.__name__) if callable(policy) else (policies.POLICIES[policy], policy)


def _play(s, rate: float, t: float, round_s: float, tail: float, out: Result) -> float:
    """Job s's round from t at `rate` steps/s on its chips, the round's seconds spent in order on
    its owed restart, its steps, then (the last done) its final checkpoint and exit, `tail` s in
    all; records its segment (and its completion, if it comes); returns the seconds it held them."""
    left = round_s
    for phase in ("restart", "steps", "tail"):
        need = {"restart": s.owed, "steps": s.remaining / rate, "tail": tail - s.tailed}[phase]
        spent = min(left, need)
        if phase == "restart":
            s.owed -= spent
        elif phase == "steps":
            s.done = s.job.steps if spent == need else s.done + spent * rate
        else:
            s.tailed = tail if spent == need else s.tailed + spent
        left -= spent
        if spent < need:
            break
    busy = round_s - left
    s.attained += s.current[1] * busy
    out.segments.append((s.job.name, *s.current, t, t + busy))
    if s.done == s.job.steps and s.tailed == tail:
        name, alone = s.job.name, s.job.steps / max(
            r for (_, n), r in out.rates[s.job.name].items() if n == s.job.scale)
        out.finish[name], out.jct[name] = t + busy, t + busy - s.job.arrival
        out.ftf[name] = out.jct[name] / (alone * s.contention / s.age)
    return busy


def gpu_restart(job, where, first: bool) -> float:
    """A start's cost on GPUs (throughput.py): the start-up, and for a resume the checkpoint's
    load."""
    return STARTUP_S + (0.0 if first else checkpoint_seconds(job.kind))


def gpu_stop(job, where) -> float:
    """A stop's cost on GPUs: the checkpoint's save (throughput.py)."""
    return checkpoint_seconds(job.kind)


def _merged(segments: list) -> list:
    """Consecutive rounds of one job on the same (kind, count) as one segment."""
    out, last = [], {}
    for seg in segments:
        i = last.get(seg[0])
        if i is not None and out[i][1:3] == seg[1:3] and abs(out[i][4] - seg[3]) < 1e-9:
            out[i] = (*out[i][:4], seg[4])
        else:
            last[seg[0]] = len(out)
            out.append(seg)
    return out
