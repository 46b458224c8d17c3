"""Pipeline schedules as data: for each pipeline rank, the list of actions it runs, in order.

A pipeline cuts the model into chunks (stages), one rank each, and a batch into m micro-batches, so
that while rank 1 runs micro-batch 0, rank 0 can already run micro-batch 1. The order in which each
rank runs its forwards (F) and backwards (B, or B = input gradient and W = weight gradient when the
backward is split) is the schedule; it decides the idle time (the bubble) and how many
micro-batches' activations a rank must keep (memory). Simplest first, p ranks, m micro-batches, T_F,
T_B, T_W per micro-batch:

    gpipe             all F, then all B (Huang et al. 2019). Bubble (p-1)/m of the ideal time, i.e.
                      a fraction (p-1)/(m+p-1) of the step; every rank keeps m micro-batches'
                      activations (GPipe's paper recomputes them: here recompute="full").
    1f1b              1F1B (PipeDream, Harlap et al. 2018), synchronous with a flush as
                      PipeDream-Flush (Narayanan et al., ICML 2021) and Megatron-LM run it: rank r
                      runs p-1-r forwards (warm-up), then alternates one F and one B, then drains
                      its Bs (cool-down). Same bubble as GPipe, but rank r keeps at most p-r
                      micro-batches: activation memory bounded by p, not m.
    interleaved-1f1b  Megatron's interleaved schedule (Narayanan et al. 2021): each rank holds v
                      chunks (chunk k on rank k % p), so a micro-batch goes round the ranks v times
                      and the fill and drain are v times shorter: bubble (p-1)/(v·m) of the ideal
                      time, for v times more point-to-point messages; memory grows by a factor 1 +
                      (p-1)/(p·v) on rank 0. Needs m to be a multiple of p (as Megatron does).
    zb-h1             Zero Bubble ZB-H1 (Qi et al. 2023): split the backward into B (needed by the
                      previous rank) and W (needed by nobody but the optimizer); rank r defers up to
                      r Ws and runs them in the cool-down, where 1F1B idles. Bubble per rank
                      (p-1)(T_F+T_B-T_W) instead of 1F1B's (p-1)(T_F+T_B+T_W),
                      with the same peak memory p·M_B.

    Action("F", stage=3, microbatch=5): run the forward of model chunk 3 on micro-batch 5.

`stage` is always the global chunk index 0 .. p·v-1; the chunk runs on rank `rank_of(stage, p)`.
Communication: each chunk boundary sends one activation (b·s·h) forward and one gradient back per
micro-batch, so 2·(p·v-1)·m messages per step; a schedule only reorders them.

`check` verifies any action list (hand-written ones too); `replay` runs it in dependency order, the
same rule the runtime follows: sends never block, an action waits only for the inputs it needs.
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

OPS = ("F", "B", "W")


class Action(NamedTuple):
    op: str          # "F" forward, "B" backward (input gradient; the whole
                     #   backward if no W), "W" weight grad
    stage: int       # global model chunk, 0 .. stages * virtual_stages - 1
    microbatch: int

    def __str__(self):
        return f"{self.op}{self.microbatch} of chunk {self.stage}"


def rank_of(stage: int, stages: int) -> int:
    """The pipeline rank that holds global chunk `stage` (Megatron's
    placement: chunk k on rank k % p).

        v = 2, p = 4:   rank 0: chunks 0, 4    rank 1: 1, 5    rank 2: 2, 6    rank 3: 3, 7
    """
    return stage % stages


def stage_of(rank: int, virtual: int, stages: int) -> int:
    """The global chunk index of rank `rank`'s `virtual`-th local chunk (0 .. virtual_stages-1)."""
    return virtual * stages + rank


def inputs(action: Action, chunks: int) -> list[Action]:
    """The actions whose results `action` needs: the data edges of the schedule.

    F of chunk c needs F of chunk c-1 (its input activation); B of c needs F of c (its saved
    activations) and B of c+1 (the gradient of its output), unless
    c is the last chunk; W needs its B.
    """
    op, c, mb = action
    if op == "F":
        return [Action("F", c - 1, mb)] if c > 0 else []
    if op == "B":
        return [Action("F", c, mb)] + ([Action("B", c + 1, mb)] if c < chunks - 1 else [])
    return [Action("B", c, mb)]


def validate(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError naming the field and the rule if this schedule cannot be built."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {name!r}")
    for field, value in (("stages", stages), ("microbatches", microbatches),
                         ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    if virtual_stages > 1 and name != "interleaved-1f1b":
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule 'interleaved-1f1b', got "
                         f"{name!r}")
    if name == "interleaved-1f1b" and microbatches % stages:
        raise ValueError(f"interleaved-1f1b needs microbatches ({microbatches}) to be a multiple "
                         "of stages "
                         f"({stages}): micro-batches go round the ranks in groups of p (Megatron's "
                         "rule)")


# ----------------------------------------------------------------------------- the schedules


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards: rank r keeps every
    micro-batch's activations until its B."""
    return [[Action("F", r, i) for i in range(microbatches)] + [Action("B", r, i)
                                                                for i in range(microbatches)]
            for r in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """PipeDream-Flush. Rank r's first B can only start once micro-batch 0 has gone down to the last
    rank and back, so it fills that wait with p-1-r forwards; from then on each F is paired with a
    B, which keeps at most p-r micro-batches alive. Works for m < p
    too (the warm-up is then all of m)."""
    plan = []
    for r in range(stages):
        warmup = min(stages - 1 - r, microbatches)
        ops = [Action("F", r, i) for i in range(warmup)]
        for i in range(microbatches - warmup):  # steady state: F of micro-batch warmup+i, B of i
            ops += [Action("F", r, warmup + i), Action("B", r, i)]
        ops += [Action("B", r, i) for i in range(microbatches - warmup, microbatches)]  # cool-down
        plan.append(ops)
    return plan


def interleaved_1f1b(stages: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B. Each rank walks its m·v (chunk, micro-batch) units in groups of
    p micro-batches: p forwards of its first chunk, then p of its second, ... then the next p
    micro-batches; backwards in the same groups, chunks in reverse.
    The warm-up is (p-1-r)·2 + (v-1)·p
    forwards: enough for micro-batch 0 to reach the last chunk and its gradient to come back."""
    p, m, v = stages, microbatches, virtual_stages
    if v == 1:
        return one_f_one_b(p, m)

    def unit(k: int, forward: bool) -> tuple[int, int]:  # k-th forward (or backward) unit
                                                         #   -> (chunk, mb)
        group, within = divmod(k, p * v)
        local = (k // p) % v
        return (local if forward else v - 1 - local), group * p + within % p

    plan = []
    for r in range(p):
        warmup = min(2 * (p - 1 - r) + (v - 1) * p, m * v)
        F = [Action("F", stage_of(r, c, p), mb) for c, mb in (unit(k, True) for k in range(m * v))]
        B = [Action("B", stage_of(r, c, p), mb) for c, mb in (unit(k, False) for k in range(m * v))]
        ops = F[:warmup]
        for i in range(m * v - warmup):
            ops += [F[warmup + i], B[i]]
        plan.append(ops + B[m * v - warmup:])
    return plan


def zb_h1(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order of F and B, with W split off. Rank r keeps up to r Ws pending (their
    activations stay alive, so in-flight stays <= p = rank 0's 1F1B peak) and runs them once its Bs
    are done, in the time 1F1B's cool-down leaves idle; rank 0 runs each W right after its B."""
    plan = []
    for r, ops in enumerate(one_f_one_b(stages, microbatches)):
        out, pending = [], []
        for a in ops:
            out.append(a)
            if a.op == "B":
                pending.append(Action("W", a.stage, a.microbatch))
                if len(pending) > r:
                    out.append(pending.pop(0))
        plan.append(out + pending)
    return plan


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved-1f1b": interleaved_1f1b,
             "zb-h1": zb_h1}


def schedule(name: str, stages: int, microbatches: int,
             virtual_stages: int = 1) -> list[list[Action]]:
    """The actions of each pipeline rank, in execution order: `schedule("1f1b", 4, 8)[rank]`."""
    validate(name, stages, microbatches, virtual_stages)
    if name == "interleaved-1f1b":
        return interleaved_1f1b(stages, microbatches, virtual_stages)
    return SCHEDULES[name](stages, microbatches)


class Schedule(tuple):
    """A `cached_schedule`: each rank's tuple of actions, immutable, carrying what is derived from
    it (`derived`)."""


@functools.lru_cache(maxsize=256)
def cached_schedule(name: str, stages: int, microbatches: int,
                    virtual_stages: int = 1) -> Schedule:
    """`schedule`, cached and immutable (a tuple of each rank's tuple of actions): the planner, its
    plots and the memory model walk the same schedules many times, and may share them safely."""
    actions = Schedule(map(tuple, schedule(name, stages, microbatches, virtual_stages)))
    check(actions, stages, microbatches, virtual_stages)   # once: callers may simulate unchecked
    return actions


# -----------------------------------------------------------------------------
# checking any action list


def replay(actions: list[list[Action]], stages: int, virtual_stages: int = 1, duration=None,
           latency=0.0):
    """Run the ranks' lists in dependency order: each rank runs its next action as soon as its
    inputs are done (plus `latency` if they come from another rank). duration(rank, action) -> time,
    0 if None.

    Returns ({action: (rank, start, end)}, stuck), stuck being [(rank, action, missing input)] for
    the ranks that could not finish: a deadlock, i.e. a cycle of same-rank order and data edges.
    """
    order, stuck = derived(run_order, actions, stages * virtual_stages)
    times = [duration(r, a) for r, a, _ in order] if duration else [0.0] * len(order)
    starts, ends = replay_times(order, len(actions), times, latency)
    return {a: (r, s, e) for (r, a, _), s, e in zip(order, starts, ends)}, list(stuck)


def replay_times(order: tuple, ranks: int, times: list, latency: float) -> tuple[list, list]:
    """(start, end) lists of `run_order`'s actions, each taking times[i] (i: its position in the
    order)."""
    starts, ends, clock = [0.0] * len(order), [0.0] * len(order), [0.0] * ranks
    for i, (r, _, needs) in enumerate(order):
        start = clock[r]
        for j in needs:   # (plain loops: the planner replays 10^5-action schedules)
            end = ends[j] + latency
            if end > start:
                start = end
        starts[i], ends[i] = start, start + times[i]
        clock[r] = ends[i]
    return starts, ends


def derived(fn, actions, *args):
    """fn(actions, *args), found once for a `cached_schedule` and kept with it (what the planner
    derives from one schedule many times over: an order to replay it in, the activations in
    flight), else each call. Kept on the schedule, not in a cache keyed by its value: hashing a
    schedule walks all its actions, 10^5 in a large pipeline."""
    if not isinstance(actions, Schedule):
        return fn(actions, *args)
    found = actions.__dict__.setdefault("derived", {})
    if (fn, args) not in found:
        found[fn, args] = fn(actions, *args)
    return found[fn, args]


def run_order(actions: tuple, chunks: int) -> tuple[tuple, tuple]:
    """(an order `replay` can run the actions in, as (rank, action, the positions in the order of
    its inputs from other ranks)); stuck): each rank in its list's order, each action after its
    inputs. An input on its own rank ran before the rank's previous action ended, so only the
    others can make it wait. Which order that is does not depend on the durations, so a
    schedule's is found once (`derived`)."""
    order, done, nxt = [], {}, [0] * len(actions)
    waiting, ready = {}, list(range(len(actions)))   # input -> ranks blocked on it; ranks to run
    while ready:
        r = ready.pop()
        ops = actions[r]
        while nxt[r] < len(ops):
            a = ops[nxt[r]]
            needs = inputs(a, chunks)
            missing = next((d for d in needs if d not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            order.append((r, a, tuple(done[d][0] for d in needs if done[d][1] != r)))
            done[a] = (len(order) - 1, r)   # its position in the order, its rank
            nxt[r] += 1
            ready += waiting.pop(a, ())
    stuck = [(r, ops[nxt[r]], next(d for d in inputs(ops[nxt[r]], chunks) if d not in done))
             for r, ops in enumerate(actions) if nxt[r] < len(ops)]
    return tuple(order), tuple(stuck)


def in_flight(actions, chunks: int) -> list[tuple]:
    """Per rank: (its chunks, the states its actions pass through, the empty one included, each
    as (micro-batches in flight per chunk of its chunks: F run, the last backward op not yet;
    those of the last chunk past B but not W)). An F makes its chunk's micro-batch held, the last
    backward op (W if the schedule splits backward, else B) frees it; with W apart, B frees only
    the loss's part (after the last module). A rank's activations in a state are its held bytes
    less the loss's of the micro-batches past B (memory.pipeline_activations): its peak is one
    of these states', so the states that another one bounds are left out."""
    out = []
    for ops in actions:
        split = any(a.op == "W" for a in ops)
        mine = sorted({a.stage for a in ops})
        at, counts, past_b = {k: i for i, k in enumerate(mine)}, [0] * len(mine), 0
        states = {((0,) * len(mine), 0)}
        for a in ops:
            if a.op == "F":
                counts[at[a.stage]] += 1
            elif a.op == "W" or not split:
                counts[at[a.stage]] -= 1
                past_b -= split and a.stage == chunks - 1
            elif a.stage == chunks - 1:   # B with W apart: the loss's part freed
                past_b += 1
            states.add((tuple(counts), past_b))
        # held bytes and the loss's are >= 0: a state with as many in flight on every chunk or
        # more, and as few past B or fewer, holds as much or more; only the others are kept
        kept = []
        for c, b in sorted(states, key=lambda x: (-sum(x[0]), x[1])):
            if not any(all(x >= y for x, y in zip(k, c)) and kb <= b for k, kb in kept):
                kept.append((c, b))
        out.append((tuple(mine), tuple(kept)))
    return out


def check(actions: list[list[Action]], stages: int, microbatches: int,
          virtual_stages: int = 1) -> None:
    """Raise ValueError naming the first rule that `actions` break
    (which rank, which action), else None.

    Rules: one list per rank; each action is a valid F/B/W of an existing chunk and micro-batch, on
    the rank that holds the chunk, at most once; an action comes after the inputs it has on its own
    rank (B after its F, W after its B); every F and B appears; W for every (chunk, micro-batch) or
    for none; and the ranks do not deadlock waiting for each other's results.
    """
    chunks = stages * virtual_stages
    if _valid(actions, stages, microbatches, chunks):
        return
    if len(actions) != stages:
        raise ValueError(f"expected one action list per pipeline rank ({stages}), got "
                         f"{len(actions)}")
    seen = set()
    for r, ops in enumerate(actions):
        for i, a in enumerate(ops):
            where = _Where(r, i, a)   # named only in an error: 10^5 actions in a large pipeline
            if (
                len(a) != 3
                or a[0] not in OPS
                or not 0 <= a[1] < chunks
                or not 0 <= a[2] < microbatches
            ):
                raise ValueError(f"{where}: not a valid action (op in {OPS}, chunk < {chunks}, "
                                 f"micro-batch < {microbatches})")
            a = Action(*a)
            if rank_of(a.stage, stages) != r:
                raise ValueError(f"{where}: chunk {a.stage} lives on rank "
                                 f"{rank_of(a.stage, stages)} "
                                 f"(chunk k on rank k % {stages}), not on rank {r}")
            if a in seen:
                raise ValueError(f"{where}: duplicate, {a} already ran (each action runs exactly "
                                 "once)")
            for d in inputs(a, chunks):
                if rank_of(d.stage, stages) == r and d not in seen:
                    raise ValueError(f"{where}: {a} needs {d}, which must come earlier on the same "
                                     "rank")
            seen.add(a)
    has_w = any(a.op == "W" for a in seen)
    for c in range(chunks):
        for mb in range(microbatches):
            for op in ("F", "B", "W") if has_w else ("F", "B"):
                if Action(op, c, mb) not in seen:
                    rule = "W for every (chunk, micro-batch) or for none" if op == "W" else \
                        "every F and B of every chunk and micro-batch must appear"
                    raise ValueError(f"rank {rank_of(c, stages)}: missing {Action(op, c, mb)!r} "
                                     f"({rule})")
    _, stuck = derived(run_order, actions, chunks)   # found once for a cached schedule
    if stuck:
        waits = "; ".join(f"rank {r} at {a} waits for {d} (rank {rank_of(d.stage, stages)})" for r,
                          a, d in stuck)
        raise ValueError(f"deadlock: {waits}")


def _valid(actions, stages: int, microbatches: int, chunks: int) -> bool:
    """`check`'s verdict, fast, for the schedules that pass (the planner's have 10^5 actions):
    the actions are the expected set, once each (every F and B, W for all or none), each on its
    chunk's rank, and `run_order` finishes, which it does not when an action precedes an input on
    its own rank (the rank would wait for itself) or the ranks wait in a circle. False: `check`
    walks them one by one to name the first broken rule."""
    try:
        every = [a for ops in actions for a in ops]
        seen = set(every)
        ops = "FBW" if ("W", chunks - 1, 0) in seen else "FB"
        if len(actions) != stages or len(seen) != len(every) or seen != set(
                itertools.product(ops, range(chunks), range(microbatches))):
            return False
    except TypeError:  # an unhashable action
        return False
    return all(a[1] % stages == r for r, ops in enumerate(actions) for a in ops) and \
        not derived(run_order, actions, chunks)[1]


class _Where(NamedTuple):
    """Which action `check` is at, written out only in its error message."""
    rank: int
    index: int
    action: tuple

    def __str__(self) -> str:
        return f"rank {self.rank}, action {self.index} ({self.action!r})"
