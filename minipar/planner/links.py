"""The links' collectives, timed: what a ring all-reduce, all-gather or reduce-scatter, an
all-to-all and a point-to-point message take on a `Link` (bandwidth, latency), and what a
collective overlapped with compute still costs (`exposed`). gpu_time.py and gpu_cp_ep.py time
every message of a step with them.
"""
from __future__ import annotations

from minipar.planner.cluster import Link


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes`: 2(n-1)/n of it sent by each rank, 2(n-1) steps."""
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def gather_or_scatter(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather or reduce-scatter whose full tensor is `nbytes`: (n-1)/n of it, n-1 steps."""
    return 0.0 if n == 1 else (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def p2p(nbytes: float, link: Link) -> float:
    return nbytes / link.bandwidth + link.latency


def all_to_all(nbytes: float, n: int, link: Link) -> float:
    """An all-to-all of `nbytes` a rank, evenly spread: (n-1)/n of it leaves, n-1 messages."""
    return 0.0 if n == 1 else (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


# Overlapped communication slows the compute it hides under: the kernels share the GPU's SMs and
# memory. Galvatron measured 1.3x for computation overlapped with communication (Hetu-Galvatron's
# overlap test); minipar charges it on the overlapped span: hiding x seconds of communication under
# compute costs (SLOWDOWN - 1) x.
SLOWDOWN = 1.3
def exposed(comm: float, window: float) -> float:
    """Seconds that `comm` seconds of communication add to a step when issued under `window`
    seconds of compute: what sticks out, and the slowdown of the compute it hid under."""
    return max(0.0, comm - window) + (SLOWDOWN - 1) * min(comm, window)
