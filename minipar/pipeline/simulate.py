"""A schedule plus per-op costs gives a timeline: when each action
runs, the bubble, the memory held.

The simulator follows the runtime's rule (see `schedules.replay`): each rank runs its actions in
order, an action starts when its rank is free and its inputs are done, and an input from another
rank arrives `latency` later (the point-to-point send). Nothing else
is modelled: no bandwidth, no overlap.

    bubble          = total idle time / (ranks · makespan): the fraction of the step the ranks wait;
                      idle counts from the first start of any rank to the last end of any rank.
    in flight       = on one rank, the (chunk, micro-batch) pairs whose F has run and whose backward
                      (B, and W if the schedule splits it) has not finished: the activations it
                      holds. With v chunks per rank, each pair holds 1/v of the rank's layers.

Published figures the tests check, for F = B = 1 per micro-batch and rank (no W):
    gpipe, 1f1b       bubble (p-1)/(m+p-1)          (bubble time / ideal time = (p-1)/m)
    interleaved-1f1b  bubble (p-1)/(v·m+p-1)        with each chunk's F and B costing 1/v
    zb-h1             idle per rank (p-1)(T_F+T_B-T_W) with F, B, W split, when T_W <= T_F (more
                      idle beyond: W no longer fits the gaps); peak in flight p on every rank

A measured run (the runtime's per-rank (action, start_s, end_s) lists) becomes a Timeline through
`Timeline.from_events`, so the same bubble, Gantt chart and trace work on it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from minipar.pipeline.schedules import OPS, Action, check, derived, replay_times, run_order


@dataclass
class Timeline:
    """Per-rank lists of (action, start, end), sorted by start. Times in seconds (or cost units)."""
    events: list[list[tuple[Action, float, float]]]

    @classmethod
    def from_events(cls, events) -> "Timeline":
        """From any per-rank lists of (action, start, end), e.g. measured perf_counter times:
        actions may be plain (op, stage, microbatch) tuples; times are shifted so that the first
        start is 0."""
        t0 = min((s for rank in events for _, s, _ in rank), default=0.0)
        return cls([sorted(((Action(*a), s - t0, e - t0) for a, s, e in rank), key=lambda x: x[1])
                    for rank in events])

    @property
    def ranks(self) -> int:
        return len(self.events)

    @property
    def makespan(self) -> float:
        ranks = [rank for rank in self.events if rank]
        if not ranks:
            return 0.0
        return max(e for rank in ranks for _, _, e in rank) - min(s for rank in ranks
                                                                  for _, s, _ in rank)

    @property
    def busy(self) -> list[float]:
        return [sum(e - s for _, s, e in rank) for rank in self.events]

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Total idle / (ranks · makespan)."""
        return sum(self.idle) / (self.ranks * self.makespan) if self.makespan else 0.0

    @property
    def peak_in_flight(self) -> list[int]:
        """Per rank, the most (chunk, micro-batch) pairs alive at once: F run, backward not finished
        (its last op: W if the schedule has Ws, else B). Order of
        the events, so ties do not matter."""
        split = any(a.op == "W" for rank in self.events for a, _, _ in rank)
        last = "W" if split else "B"
        peaks = []
        for rank in self.events:
            alive = peak = 0
            for a, _, _ in rank:
                alive += (a.op == "F") - (a.op == last)
                peak = max(peak, alive)
            peaks.append(peak)
        return peaks

    def __repr__(self):
        return (f"Timeline(ranks={self.ranks}, makespan={self.makespan:.4g}, "
                f"bubble={self.bubble:.3f}, "
                f"peak_in_flight={self.peak_in_flight})")


def _cost_table(cost, chunks: int, split: bool) -> dict:
    """cost {"F": t, "B": t, "W": t}, each a number or a list per
    chunk -> {op: [its time on each chunk]}."""
    for op in cost:
        if op not in ("F", "B", "W"):
            raise ValueError(f"cost keys must be 'F', 'B', 'W', got {op!r}")
    table = {}
    for op in ("F", "B", "W"):
        t = cost.get(op, 0.0)
        t = list(t) if isinstance(t, (list, tuple)) else [t] * chunks
        if len(t) != chunks:
            raise ValueError(
                f"cost[{op!r}] has {len(t)} entries, expected one per chunk ({chunks})"
            )
        table[op] = t
    if not split:  # B is the whole backward: input gradient and weight gradient together
        table["B"] = [b + w for b, w in zip(table["B"], table["W"])]
    return table


def simulate(actions: list[list[Action]], stages: int, microbatches: int, virtual_stages: int = 1,
             cost=None, latency: float = 0.0, checked: bool = False) -> Timeline:
    """The timeline of `actions` (checked first) when each op takes
    cost[op] and each message `latency`.

    cost: {"F": t_F, "B": t_B, "W": t_W} (default 1, 1, 1), each a number or one number per global
    chunk. Per action, i.e. per (chunk, micro-batch): with v chunks per rank, pass a rank's per
    micro-batch cost divided by v to compare schedules at equal model size. "B" is the input
    gradient and "W" the weight gradient; a schedule with no W actions runs the whole backward in
    its B, which then costs t_B + t_W (a missing key counts 0). checked=True skips `check`, for
    actions that passed it already (`cached_schedule`'s: the planner simulates them many times).
    """
    replay = replayed(actions, stages, microbatches, virtual_stages, cost, latency, checked)
    return replay.timeline()


class Replay(NamedTuple):
    """A schedule replayed with costs (`replayed`): each action's start and end, by its position
    in the replay's order; the schedule's ranks and the Timeline are found when asked (the planner
    replays thousands and reads their makespan)."""
    starts: list
    ends: list
    actions: tuple   # the schedule replayed
    chunks: int

    @property
    def ranks(self) -> list:
        """Per rank [(action, its position in the replay's order)]."""
        return derived(_positions, self.actions, self.chunks)

    @property
    def makespan(self) -> float:
        return max(self.ends) - min(self.starts) if self.starts else 0.0

    def timeline(self) -> Timeline:
        return Timeline([[(a, self.starts[i], self.ends[i]) for a, i in mine]
                         for mine in self.ranks])


def replayed(actions: list[list[Action]], stages: int, microbatches: int, virtual_stages: int = 1,
             cost=None, latency: float = 0.0, checked: bool = False, free: bool = False):
    """`simulate`'s replay, its Timeline not built yet (arguments as simulate's). free=True:
    (the Replay, the makespan without the latency), from one walk."""
    if not checked:
        check(actions, stages, microbatches, virtual_stages)
    cost = {"F": 1.0, "B": 1.0, "W": 1.0} if cost is None else cost
    chunks = stages * virtual_stages
    order, split, keys = derived(_keyed_order, actions, chunks)
    table = _cost_table(cost, chunks, split)
    times = list(map((table["F"] + table["B"] + table["W"]).__getitem__, keys))
    if free:
        starts, ends, makespan = replay_times_free(order, len(actions), times, latency)
        return Replay(starts, ends, actions, chunks), makespan
    return Replay(*replay_times(order, len(actions), times, latency), actions, chunks)


def replay_times_free(order: tuple, ranks: int, times: list,
                      latency: float) -> tuple[list, list, float]:
    """schedules.replay_times and, in the same walk, the makespan without the latency (the planner
    wants both: the step, and how much of it the messages add)."""
    starts, ends, clock = [0.0] * len(order), [0.0] * len(order), [0.0] * ranks
    free, idle = [0.0] * len(order), [0.0] * ranks
    for i, (r, _, needs) in enumerate(order):
        start, start0 = clock[r], idle[r]
        for j in needs:
            end = ends[j] + latency
            if end > start:
                start = end
            if free[j] > start0:
                start0 = free[j]
        starts[i], ends[i], free[i] = start, start + times[i], start0 + times[i]
        clock[r], idle[r] = ends[i], free[i]
    return starts, ends, max(free, default=0.0)


def _keyed_order(actions, chunks: int) -> tuple:
    """(`run_order` of the schedule, whether it has W actions, each action's place in the cost
    table in that order: op F, B, W times chunks plus its chunk)."""
    order, _ = derived(run_order, actions, chunks)
    return (order, any(a[0] == "W" for ops in actions for a in ops),
            [OPS.index(a[0]) * chunks + a[1] for _, a, _ in order])


def _positions(actions, chunks: int) -> list:
    """Per rank its actions, as Actions, with their positions in `run_order`'s order."""
    at = {a: i for i, (_, a, _) in enumerate(derived(run_order, actions, chunks)[0])}
    return [[(a if type(a) is Action else Action(*a), at[a]) for a in ops]  # plain tuples too
            for ops in actions]


def to_chrome_trace(timeline: Timeline, path=None) -> dict:
    """Chrome trace-event JSON of a timeline (open it in
    https://ui.perfetto.dev or chrome://tracing).

    One complete ("X") event per action, named like "F3" (op and micro-batch), on thread `rank` of
    process 0, times in microseconds (a timeline's times are taken as
    seconds). Written to `path` if given.
    """
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "pipeline"}}]
    for r, rank in enumerate(timeline.events):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r,
                       "args": {"name": f"pp rank {r}"}})
        for a, s, e in rank:
            events.append({"ph": "X", "name": f"{a.op}{a.microbatch}", "cat": a.op, "pid": 0,
                           "tid": r,
                           "ts": s * 1e6, "dur": (e - s) * 1e6,
                           "args": {"op": a.op, "stage": a.stage, "microbatch": a.microbatch}})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
