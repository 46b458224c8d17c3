"""Lesson 02's exercise and its grader: the dynamic loss scaler (reference answer:
`minipar.lessons.solutions.loss_scale_update`).

    check_loss_scaler(update)   the learner's update rule, against minipar.precision.LossScaler

The learner writes the rule as a function of the scaler's state, without a class:

    update(scale, good_steps, found_inf, *, growth, backoff, growth_interval)
        -> (scale, good_steps)

The grader drives it and a real `LossScaler` through the same sequences of steps with and without
an overflow (long runs that reach the growth interval, an overflow right after a growth, one in the
middle of a run, several in a row, a random mix) and compares the state after every step, with
GradScaler's interval (2000) and a short one (3). The first step where they differ is reported,
with what each gave and which part of the rule it breaks. (LossScaler has no floor or ceiling on
the scale: a run of overflows halves it every step, and the grader checks that too.)
"""
from __future__ import annotations

import random

from minipar.precision import LossScaler


def sequences(interval: int) -> dict[str, list[bool]]:
    """Named runs of found_inf flags (True: this step's gradients overflowed) for a scaler whose
    growth interval is `interval`."""
    good, bad = [False], [True]
    rng = random.Random(interval)
    return {
        "no overflow, two growth intervals and one step": good * (2 * interval + 1),
        "an overflow on the first step": bad + good * interval,
        "an overflow right after a growth": good * interval + bad + good * (interval + 1),
        "an overflow one step before a growth": good * (interval - 1) + bad + good * interval,
        "overflows in a row (no floor on the scale)": bad * 5 + good * interval,
        "a random mix (1 step in 8 overflows)": [rng.random() < 1 / 8 for _ in range(6 * interval)],
    }


def _what_broke(found_inf: bool, before: tuple, got: tuple, want: tuple, scaler) -> str:
    """Which part of the rule the first wrong step breaks, from the state before it."""
    scale, good = before
    if found_inf:
        if got[0] != scale * scaler.backoff:
            return (f"on an overflow the scale is multiplied by backoff = {scaler.backoff} "
                    f"({scale:g} -> {scale * scaler.backoff:g})")
        return "an overflow resets good_steps to 0 (the run of good steps starts again)"
    grew_want, grew_got = want[0] != scale, got[0] != scale
    if grew_want and not grew_got:
        return (f"the step that makes good_steps reach growth_interval = {scaler.growth_interval} "
                f"multiplies the scale by growth = {scaler.growth} (here the "
                f"{scaler.growth_interval}th good step in a row): yours grew late or never")
    if grew_got and not grew_want:
        return (f"the scale grows only when good_steps reaches growth_interval = "
                f"{scaler.growth_interval}; yours grew after {good + 1} good steps counted "
                "(too early, or good_steps was not reset by an overflow or a growth)")
    if grew_got and got[0] != want[0]:
        return f"a growth multiplies the scale by growth = {scaler.growth}"
    return ("a step without overflow adds 1 to good_steps, and the step that grows the scale "
            "resets it to 0")


def check_loss_scaler(update, intervals=(2000, 3)) -> str:
    """Runs `update` and minipar's LossScaler side by side through `sequences(interval)` for each
    growth interval; returns a report, or raises AssertionError at the first step that differs."""
    steps = 0
    for interval in intervals:
        for name, flags in sequences(interval).items():
            scaler = LossScaler(growth_interval=interval)
            state = (scaler.scale, scaler.good_steps)
            for i, found_inf in enumerate(flags):
                got = update(*state, found_inf, growth=scaler.growth, backoff=scaler.backoff,
                             growth_interval=interval)
                scaler.update(found_inf)
                want = (scaler.scale, scaler.good_steps)
                if not (isinstance(got, tuple) and len(got) == 2):
                    raise AssertionError(f"update must return a tuple (scale, good_steps); it "
                                         f"returned {got!r}")
                if tuple(got) != want:
                    hint = _what_broke(found_inf, state, got, want, scaler)
                    kind = "an overflow" if found_inf else "no overflow"
                    raise AssertionError(
                        f"growth_interval {interval}, sequence '{name}', step {i} ({kind}), "
                        f"from scale {state[0]:g}, good_steps {state[1]}: yours gave scale "
                        f"{got[0]:g}, good_steps {got[1]}; LossScaler gives scale {want[0]:g}, "
                        f"good_steps {want[1]}. {hint[0].upper()}{hint[1:]}.")
                state = got
                steps += 1
    count = len(sequences(3)) * len(intervals)
    return (f"right: {count} sequences, {steps} steps, growth intervals {list(intervals)}: after "
            "every step your (scale, good_steps) equals minipar.precision.LossScaler's")
