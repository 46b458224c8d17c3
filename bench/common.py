"""What the step-time benchmarks (ddp, zero, tp, pp) share: their timing
options and the commit they ran at."""
from __future__ import annotations

import os
import pathlib
import statistics
import subprocess
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"  # tables and plots


def add_timing_arguments(parser, defaults: dict) -> None:
    """--reps, --warmup, --launches, --threads, with each benchmark's own defaults."""
    parser.add_argument("--reps", type=int, default=defaults["reps"], help="timed steps per "
                                                                           "variant and launch")
    parser.add_argument("--warmup", type=int, default=defaults["warmup"], help="untimed steps per "
                                                                               "variant first")
    parser.add_argument("--launches", type=int, default=defaults["launches"], help="fresh launches "
                                                                                   "per world")
    parser.add_argument("--threads", type=int, default=defaults["threads"],
                        help="intra-op threads per rank (0: launch's choice, CPUs // world)")


def settings(defaults: dict, args=None, overrides: dict | None = None) -> dict:
    """A benchmark's settings: `defaults`, then parsed `args`
    (bench/run.py), then keyword `overrides`."""
    given = {k: v for k, v in (vars(args) if args else {}).items() if k in defaults}
    return {**defaults, **given, **(overrides or {})}


def launch_rounds(worlds, launches: int, start) -> dict[int, list]:
    """{world: [start(world, i) for launch i]}, round by round: launch i of every world before
    launch i + 1 of any, so that the machine's drift over the run falls on every world alike."""
    results = {world: [] for world in worlds}
    for i in range(launches):
        for world in results:
            results[world].append(start(world, i))
    return results


def start(out_dir) -> tuple[pathlib.Path, tuple[float, float]]:
    """Before a run: its output folder (made) and what `footer`
    needs (the load average, the time)."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(exist_ok=True)
    return out_dir, (os.getloadavg()[0], time.perf_counter())


def footer(threads: int, since: tuple[float, float], command: str) -> str:
    """The results' last lines: the machine, torch, the threads per rank, the load before and after
    the run (`since`, from `start`), its length, the commit, and the command that repeats it."""
    import torch
    load_before, started = since
    per_rank = f"{threads} intra-op thread(s) per rank" if threads else \
        "max(1, CPUs // N) threads per rank"
    return (f"Machine: {os.cpu_count()} CPUs, torch {torch.__version__}; {per_rank}; 1-minute load "
            f"average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after; "
            f"{time.perf_counter() - started:.0f} s in all; minipar at {version()}.\n"
            f"Command: `{command}`\n")


def ratios(slowest: list[dict], ours: str, theirs: str) -> dict:
    """ours / theirs step by step, from per launch {variant: each repetition's slowest-rank time}
    (`minipar.lessons.demos.slowest_rank`): the median of every ratio, and
    the lowest and highest launch's median."""
    per_launch = [[a / b for a, b in zip(launch[ours], launch[theirs])] for launch in slowest]
    medians = [statistics.median(launch) for launch in per_launch]
    return dict(ratio=statistics.median(r for launch in per_launch for r in launch),
                ratio_lo=min(medians),
                ratio_hi=max(medians))


def version() -> str:
    """The commit the code ran at ("-dirty": with uncommitted changes),
    or "?" outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True,
                              cwd=pathlib.Path(__file__).parent, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(module) -> None:
    """`python bench/<entry>.py [options]`: the entry's own options, its summary printed."""
    import argparse
    parser = argparse.ArgumentParser(description=module.__doc__.splitlines()[0])
    module.add_arguments(parser)
    print(module.run(parser.parse_args()))
