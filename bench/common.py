"""What the step-time benchmarks (ddp, zero, tp, pp) share: their timing options and the commit they ran at."""
from __future__ import annotations

import pathlib
import subprocess

RESULTS = pathlib.Path(__file__).resolve().parent / "results"  # tables and plots


def add_timing_arguments(parser, defaults: dict) -> None:
    """--reps, --warmup, --launches, --threads, with each benchmark's own defaults."""
    parser.add_argument("--reps", type=int, default=defaults["reps"], help="timed steps per variant and launch")
    parser.add_argument("--warmup", type=int, default=defaults["warmup"], help="untimed steps per variant first")
    parser.add_argument("--launches", type=int, default=defaults["launches"], help="fresh launches per world")
    parser.add_argument("--threads", type=int, default=defaults["threads"],
                        help="intra-op threads per rank (0: launch's choice, CPUs // world)")


def settings(defaults: dict, args=None, overrides: dict | None = None) -> dict:
    """A benchmark's settings: `defaults`, then parsed `args` (bench/run.py), then keyword `overrides`."""
    given = {k: v for k, v in (vars(args) if args else {}).items() if k in defaults}
    return {**defaults, **given, **(overrides or {})}


def launch_rounds(worlds, launches: int, start) -> dict[int, list]:
    """{world: [start(world, i) for launch i]}, round by round: launch i of every world before launch
    i + 1 of any, so that the machine's drift over the run falls on every world alike."""
    results = {world: [] for world in worlds}
    for i in range(launches):
        for world in results:
            results[world].append(start(world, i))
    return results


def version() -> str:
    """The commit the code ran at ("-dirty": with uncommitted changes), or "?" outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=pathlib.Path(__file__).parent, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(module) -> None:
    """`python bench/<entry>.py [options]`: the entry's own options, its summary printed."""
    import argparse
    parser = argparse.ArgumentParser(description=module.__doc__.splitlines()[0])
    module.add_arguments(parser)
    print(module.run(parser.parse_args()))
