"""Scheduling policies, simplest first: each maps a round (the jobs present, what they received so
far, the cluster's chips, the throughput matrix) to an allocation {job name: (kind, count)}.

    fifo            arrival order, no preemption: a running job keeps its chips; the first waiting
                    job takes its scale on the fastest kind for it with room, and those behind it
                    wait while it cannot (strict order)
    las             Tiresias' discretised two-dimensional least attained service (Gu et al. NSDI
                    2019): a job's service is chips x seconds received; queues split at THRESHOLDS
                    (chip-seconds, assumed), the least-served queue first, arrival order within one;
                    preemptive, each on the fastest kind with room; a job that does not fit is
                    passed over (its starvation guard is left out)
    max-min         Gavel's heterogeneity-aware max-min fairness (Narayanan et al. OSDI 2020): a
                    linear program over time fractions x[job, kind] maximises the least normalised
                    throughput sum_k rate[j, k] x[j, k] / rate_equal[j] (rate_equal: the job's rate
                    with an equal time share of the cluster spread over the kinds it fits); per kind
                    sum_j scale_j x[j, k] <= chips_k, per job sum_k x[j, k] <= 1
                    (then the most total throughput that keeps every job at that optimum)
    max-min-blind   the same fairness blind to kinds: every chip alike, so each job gets the equal
                    time share min(1, chips / sum of scales), where it ran last if there is room,
                    else on the kind with the most chips free
    max-throughput  Gavel's total-throughput policy: the same constraints, maximising the sum of
                    each job's throughput over its best rate
    minipar         chooses each job's kind, count (among those it accepts) and so its layout
                    (throughput.layout, re-planned for the allocation; checkpoints resume in any
                    layout): first the max-min optimum z* over every (kind, count), then the most
                    total normalised throughput that keeps every job at >= fairness x z*

The linear programs run over job classes (type, scale, accepted counts), not jobs: jobs of one class
are interchangeable, and both objectives are concave and symmetric in them, so an optimum that gives
each member the same fractions exists; a 10,000-job trace has a handful of classes. Fractions become
rounds as Gavel does: each round the (job, config) pairs go in order of priority x / (the fraction
of its rounds the job received there), a job holding at most one, while a kind has room; then any
waiting job that fits takes chips still free (no chip idles while a job it can run waits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

THRESHOLDS = (3600.0,)   # las: chip-seconds that move a job to the next queue (ASSUMED: one
                         #   chip-hour; Tiresias tunes its own per cluster)
FAIRNESS = 0.8           # minipar: every job keeps at least this fraction of the max-min optimum


@dataclass
class JobState:
    """One job as a policy sees it (simulate.py keeps it)."""
    job: object
    done: float = 0.0               # steps done
    attained: float = 0.0           # chip-seconds received
    current: tuple | None = None    # (kind, count) held last round
    received: dict = field(default_factory=dict)   # {(kind, count): rounds held}
    age: int = 0                    # rounds present before this one
    owed: float = 0.0               # restart seconds still to pay (runner: 1.0 while it owes)
    tailed: float = 0.0             # seconds of its final checkpoint and exit done
    never_ran: bool = True
    contention: float = 0.0         # sum over its rounds of the cluster's contention

    @property
    def remaining(self) -> float:
        return self.job.steps - self.done

    def assign(self, where) -> str | None:
        """Take this round's allocation (kind, count) or None. Returns "first" or "restart" when
        the job starts on `where` now (its first start; or again, after a pause or on other
        chips: a restart from its checkpoint), else None."""
        self.age += 1
        start = None
        if where is not None and where != self.current:
            start, self.never_ran = "first" if self.never_ran else "restart", False
        self.current = where
        if where is not None:
            self.received[where] = self.received.get(where, 0) + 1
        return start


@dataclass
class Round:
    time: float
    jobs: list          # JobState, in arrival order
    capacity: dict      # {kind: chips}
    rates: dict         # {job name: {(kind, count): steps/s}}
    options: dict = field(default_factory=dict)

    def rate(self, s: JobState, kind: str, count: int) -> float:
        """Steps/s of s on `count` chips of `kind` (0: it cannot run there, or there are fewer)."""
        return self.rates[s.job.name].get((kind, count), 0.0) if count <= self.capacity[kind] \
            else 0.0

    def fastest(self, s: JobState, free: dict, count: int):
        """The kind with room for `count` chips where s runs fastest, or None."""
        fits = [k for k in self.capacity if free[k] >= count and self.rate(s, k, count) > 0]
        return max(fits, key=lambda k: self.rate(s, k, count), default=None)


def check(view: Round, alloc: dict) -> None:
    """What any policy's allocation must satisfy: jobs present, counts they accept, a rate above 0,
    no kind over its chips."""
    present = {s.job.name: s for s in view.jobs}
    used = dict.fromkeys(view.capacity, 0)
    for name, (kind, count) in alloc.items():
        s = present.get(name)
        if s is None or count not in s.job.counts or view.rate(s, kind, count) <= 0:
            raise RuntimeError(f"policy gave {name} {count} x {kind}, which it cannot run on")
        used[kind] += count
    over = {k: n for k, n in used.items() if n > view.capacity[k]}
    if over:
        raise RuntimeError(f"policy over-allocated {over} (chips: {view.capacity})")


def fifo(view: Round) -> dict:
    free, alloc = dict(view.capacity), {}
    for s in view.jobs:
        if s.current:
            alloc[s.job.name] = s.current
            free[s.current[0]] -= s.current[1]
    for s in (s for s in view.jobs if not s.current):
        kind = view.fastest(s, free, s.job.scale)
        if kind is None:
            break   # strict order: nobody overtakes the first waiting job
        alloc[s.job.name] = (kind, s.job.scale)
        free[kind] -= s.job.scale
    return alloc


def las(view: Round) -> dict:
    thresholds = view.options.get("thresholds", THRESHOLDS)
    queue = lambda s: sum(s.attained >= t for t in thresholds)  # noqa: E731
    free, alloc = dict(view.capacity), {}
    for s in sorted(view.jobs, key=lambda s: (queue(s), s.job.arrival)):
        kind = view.fastest(s, free, s.job.scale)
        if kind is not None:
            alloc[s.job.name] = (kind, s.job.scale)
            free[kind] -= s.job.scale
    return alloc


# ----------------------------------------------------------------- the linear programs, by class


def _classes(view: Round, elastic: bool) -> dict:
    """{class key: [members' JobStates]}; a class is (type, scale, counts) and its configs."""
    out: dict = {}
    for s in view.jobs:
        out.setdefault((s.job.kind, s.job.scale, s.job.counts if elastic else ()), []).append(s)
    return out


def _configs(view: Round, s: JobState, elastic: bool) -> list:
    counts = s.job.counts if elastic else (s.job.scale,)
    return [(k, n) for k in view.capacity for n in counts if view.rate(s, k, n) > 0]


def _solve(view: Round, elastic: bool, objective: str, fairness: float = 0.0) -> dict:
    """Fractions {job name: {(kind, count): x}}: "max-min" (the least normalised throughput) or
    "sum" (total throughput over each job's best rate; with fairness > 0, every job's normalised
    throughput kept >= fairness x the max-min optimum). Variables: x per (class, config)."""
    from scipy.optimize import linprog

    groups = list(_classes(view, elastic).values())
    chips = sum(view.capacity.values())
    share = min(1.0, chips / sum(s.job.scale for s in view.jobs))
    cols, norm, best = [], [], []   # cols: (class index, config)
    for c, group in enumerate(groups):
        s = group[0]
        configs = _configs(view, s, elastic)
        cols += [(c, cfg) for cfg in configs]
        best.append(max((view.rate(s, *cfg) for cfg in configs), default=1.0))
        fit = [view.rate(s, k, s.job.scale) for k in view.capacity
               if view.rate(s, k, s.job.scale) > 0] or [best[-1]]   # (simulate refuses none)
        norm.append(share * sum(fit) / len(fit))   # its rate with an equal share of the cluster
    rate = [view.rate(groups[c][0], *cfg) for c, cfg in cols]
    value = [rate[i] / norm[c] for i, (c, _) in enumerate(cols)]   # normalised throughput
    rows = [[1.0 if cc == c else 0.0 for cc, _ in cols] for c in range(len(groups))]  # sum x <= 1
    rows += [[len(groups[c]) * n if kind == k else 0.0 for c, (kind, n) in cols]
             for k in view.capacity]                                           # a kind's chips
    bounds = [1.0] * len(groups) + [float(chips_k) for chips_k in view.capacity.values()]
    # a class's normalised throughput, negated: -(value . x) <= -floor keeps it above a floor
    floor = [[-value[i] if cc == c else 0.0 for i, (cc, _) in enumerate(cols)]
             for c in range(len(groups))]
    x, z = None, 0.0
    if objective == "max-min" or fairness > 0:   # maximise z subject to value . x >= z
        res = linprog([0.0] * len(cols) + [-1.0], A_ub=[r + [0.0] for r in rows] +
                      [r + [1.0] for r in floor], b_ub=bounds + [0.0] * len(groups),
                      bounds=[(0, None)] * (len(cols) + 1), method="highs")
        x, z = res.x[:-1], res.x[-1]
    if objective == "sum":
        extra = floor if fairness > 0 else []
        # (ties: each unit of time fraction scores 1e-6 more, so of two splits as good the one
        # that runs the jobs more of the rounds wins: it pauses them less, so restarts them less)
        res = linprog([-len(groups[c]) * (rate[i] / best[c] + 1e-6)
                       for i, (c, _) in enumerate(cols)],
                      A_ub=rows + extra,
                      b_ub=bounds + [-fairness * z * (1 - 1e-6)] * len(extra),
                      bounds=[(0, None)] * len(cols), method="highs")
        x = res.x if res.status == 0 else x   # (numerically infeasible: keep the max-min one)
    fractions = {s.job.name: {} for s in view.jobs}
    for i, (c, cfg) in enumerate(cols):
        for s in groups[c]:
            fractions[s.job.name][cfg] = x[i]
    return fractions


def _rounded(view: Round, fractions: dict, blind: bool = False) -> dict:
    """Gavel's rounds from fractions (module docstring), then the free chips filled (blind: where it
    ran last or on the kind with the most chips free; else the fastest)."""
    def priority(s, cfg, x):
        if cfg[0] == "*":   # blind: any kind, its rounds at that count
            got = sum(v for (_, n), v in s.received.items() if n == cfg[1])
        else:
            got = s.received.get(cfg, 0)
        return x / (got / s.age) if got else math.inf

    def held(s, cfg) -> bool:   # cfg is what s holds now ("*": any kind, at that count)
        return s.current is not None and cfg in (s.current, ("*", s.current[1]))

    # a job still paying for its start keeps its chips first, whatever its fractions: moved every
    # round, a job whose restart outlasts a round would never run (and a real one cannot stop
    # before its first step)
    wanted = [(i, s, cfg, x) for i, s in enumerate(view.jobs)
              for cfg, x in fractions[s.job.name].items() if x > 1e-9]
    wanted += [(i, s, s.current, 0.0) for i, s in enumerate(view.jobs) if s.owed > 0 and s.current]
    pairs = sorted((not (s.owed > 0 and held(s, cfg)), -priority(s, cfg, x), not held(s, cfg),
                    -x, s.job.arrival, i, cfg) for i, s, cfg, x in wanted)
    free, alloc = dict(view.capacity), {}

    def place(s, cfg) -> None:
        kind, count = cfg
        if kind == "*":   # blind: where it ran last if there is room, else the kind with the
            # most chips free (speeds unseen)
            room = [k for k in view.capacity if free[k] >= count and view.rate(s, k, count) > 0]
            kind = s.current[0] if s.current and s.current[0] in room else \
                max(room, key=free.get, default=None)
        if kind is not None and free[kind] >= count and view.rate(s, kind, count) > 0:
            alloc[s.job.name] = (kind, count)
            free[kind] -= count

    for *_, i, cfg in pairs:
        if view.jobs[i].job.name not in alloc:
            place(view.jobs[i], cfg)
    for s in view.jobs:   # work conservation
        if s.job.name not in alloc:
            kind = "*" if blind else view.fastest(s, free, s.job.scale)
            if kind is not None:
                place(s, (kind, s.job.scale))
    return alloc


def max_min(view: Round) -> dict:
    # the max-min optimum, then the most total throughput that keeps every job at it
    return _rounded(view, _solve(view, elastic=False, objective="sum", fairness=1.0))


def max_min_blind(view: Round) -> dict:
    chips = sum(view.capacity.values())
    share = min(1.0, chips / sum(s.job.scale for s in view.jobs))
    return _rounded(view, {s.job.name: {("*", s.job.scale): share} for s in view.jobs},
                    blind=True)


def max_throughput(view: Round) -> dict:
    return _rounded(view, _solve(view, elastic=False, objective="sum"))


def minipar(view: Round) -> dict:
    fairness = view.options.get("fairness", FAIRNESS)
    return _rounded(view, _solve(view, elastic=True, objective="sum", fairness=fairness))


POLICIES = {"fifo": fifo, "las": las, "max-min": max_min, "max-min-blind": max_min_blind,
            "max-throughput": max_throughput, "minipar": minipar}
