"""Launch a function that does no collective many times on a busy machine; count the failures.

    python bench/launch_stress.py --launches 200 --load 2 --world 2

A rank whose function does no collective finishes at once. Before a launched rank waited for
every rank's function to return before it exited (launch's module docstring), such a rank could
exit while a slower one was still connecting to it, and the slower one failed ("Gloo
connectFullMesh failed ... Connection closed by peer").
`--load` processes that spin on the CPU for the whole run make the ranks' start times drift apart,
as a busy machine does. Prints the time of a first launch, made before the load starts (it starts
the forkserver), then the number of later launches, how many failed, their median time and its
spread (the 10th to 90th percentile, the slowest), then the first failure's message.
`--load 0` times launches on an idle machine (README's launch times).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import minipar


def quiet(rank: int, line: str) -> bool:
    """launch's on_line: the ranks' hello lines are handled here, i.e. not printed."""
    return True


def stress(launches: int, load: int, world: int) -> tuple[float, list[float], list[str]]:
    """Launch demos.hello once (it starts the forkserver), then `launches` times while `load`
    processes spin, on `world` ranks.

    Returns the first launch's time (s), the time of each later one that succeeded (s) and the
    message of each that failed."""
    start = time.perf_counter()
    minipar.launch(minipar.demos.hello, world, on_line=quiet)
    first = time.perf_counter() - start
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    times, failures = [], []
    try:
        for _ in range(launches):
            start = time.perf_counter()
            try:
                minipar.launch(minipar.demos.hello, world, on_line=quiet)
            except minipar.WorkerError as err:
                failures.append(str(err))
            else:
                times.append(time.perf_counter() - start)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return first, times, failures


def spread(times: list[float]) -> str:
    """The median launch time and its spread: 10th to 90th percentile, and the slowest."""
    deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return (f"median launch {statistics.median(times):.3f} s, spread {deciles[0]:.3f}-"
            f"{deciles[-1]:.3f} s (10th-90th percentile), slowest {max(times):.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=200, help="launches to make")
    parser.add_argument("--load", type=int, default=2, help="CPU-spinning processes meanwhile")
    parser.add_argument("--world", type=int, default=2, help="ranks per launch")
    args = parser.parse_args()
    first, times, failures = stress(args.launches, args.load, args.world)
    print(f"first launch (it starts the forkserver; made before the load starts) {first:.2f} s")
    print(f"{args.launches} launches, {len(failures)} failed, " + (spread(times) if times else
          "none succeeded") + f"; world {args.world}, load {args.load}")
    if failures:
        print("first failure:\n" + failures[0])


if __name__ == "__main__":
    main()
