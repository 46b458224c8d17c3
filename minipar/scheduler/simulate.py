"""A discrete-event simulator of many training jobs on one shared cluster, in scheduling rounds.

Time moves in rounds of `round_s` (Gavel's 360 s). At each round's start the jobs that have arrived
are shown to the policy (policies.py), which returns an allocation, {job name: (kind, count)}; the
simulator checks it (no kind over its chips, counts the job accepts, a rate above 0) and runs the
round: each allocated job progresses at its rate there (the throughput matrix, steps/s). A job whose
allocation differs from its last round's was preempted or moved: it first pays a restart (its
checkpoint saved and loaded, processes started: throughput.restart_seconds; the first start pays the
start-up alone), owed across rounds if longer than one. A job that finishes mid-round leaves its
chips idle until the next round, as in Gavel.

Metrics (`Result`): each job's completion time (JCT, arrival to finish), their mean and 99th
percentile, the makespan (first arrival to last finish), utilisation (chip-seconds allocated over the
cluster's chip-seconds up to the makespan) and finish-time fairness (Themis, Mahajan et al. NSDI
2020): rho = JCT / (the job's time alone on its best kind at its scale x the cluster's contention
while it was there, max(1, chips asked by the jobs present / chips)); rho <= 1 means the job did at
least as well as an equal share of a contended cluster would give.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from minipar.scheduler import policies
from minipar.scheduler.throughput import STARTUP_S, capacity, restart_seconds, throughput_matrix


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
             restart=None, startup: float = STARTUP_S, **options) -> Result:
    """Run `jobs` on `cluster` ({kind: chips} or a Cluster) under `policy` (policies.POLICIES; its
    options, e.g. fairness= for "minipar"). rates: the throughput matrix (default: the planner's,
    throughput_matrix); restart(job) -> s a resume costs (default throughput.restart_seconds);
    startup: s a first start costs."""
    if policy not in policies.POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(policies.POLICIES)}")
    if not round_s > 0:
        raise ValueError(f"round_s must be positive seconds, got {round_s!r}")
    jobs = sorted(jobs, key=lambda j: j.arrival)
    if len({j.name for j in jobs}) != len(jobs) or not jobs:
        raise ValueError("jobs must be a non-empty list with distinct names")
    caps = capacity(cluster)
    rates = rates if rates is not None else throughput_matrix(jobs, caps)
    restart = restart or (lambda job: restart_seconds(job.kind))
    for job in jobs:
        if not any(rates[job.name].get((k, job.scale), 0) > 0 for k in caps):
            raise ValueError(f"job {job.name} ({job.model}, batch {job.global_batch}) fits on "
                             f"no kind of {sorted(caps)} at the {job.scale} chips it asks for")
    pick = policies.POLICIES[policy]
    chips = sum(caps.values())
    pending, active = collections.deque(jobs), []
    out = Result({}, {}, [], {j.name: 0 for j in jobs}, {}, 0.0, 0.0, policy=policy,
                 capacity=caps)
    held, t = 0.0, 0.0
    while pending or active:
        while pending and pending[0].arrival <= t:
            active.append(policies.JobState(pending.popleft()))
        if not active:
            t = math.ceil(pending[0].arrival / round_s) * round_s
            continue
        view = policies.Round(t, active, caps, rates, options)
        alloc = pick(view)
        policies.check(view, alloc)
        out.rounds += 1
        asked = max(1.0, sum(s.job.scale for s in active) / chips)
        for s in active:
            s.age, s.contention = s.age + 1, s.contention + asked
            where = alloc.get(s.job.name)
            if where != s.current:
                restarted = where is not None and not s.never_ran
                s.owed = restart(s.job) if restarted else startup if where else 0.0
                out.restarts[s.job.name] += restarted
                s.current = where
            if where is None:
                continue
            s.never_ran = False
            s.received[where] = s.received.get(where, 0) + 1
            r = rates[s.job.name][where]
            busy = min(round_s, s.owed + s.remaining / r)
            s.done = min(s.job.steps, s.done + max(0.0, busy - s.owed) * r)
            s.owed = max(0.0, s.owed - busy)
            s.attained += where[1] * busy
            held += where[1] * busy
            out.segments.append((s.job.name, where[0], where[1], t, t + busy))
            if s.remaining <= 1e-9 * s.job.steps:
                out.finish[s.job.name] = t + busy
                out.jct[s.job.name] = t + busy - s.job.arrival
                alone = s.job.steps / max(rates[s.job.name].get((k, s.job.scale), 0.0)
                                          for k in caps)
                out.ftf[s.job.name] = out.jct[s.job.name] / (alone * s.contention / s.age)
        active = [s for s in active if s.job.name not in out.finish]
        t += round_s
    out.makespan = max(out.finish.values()) - jobs[0].arrival
    out.utilization = held / (chips * out.makespan)
    out.segments = _merged(out.segments)
    return out


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
