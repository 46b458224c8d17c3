"""gpu_time.py's matmul model, fitted to this machine's CPU: is its form (tiles, waves, a roofline)
right on a device we can measure?

`gpu_time.matmul` times a matmul from its shape: the output cut into tiles, computed `sms` at a time
at a ceiling rate, bounded below by its bytes at memory speed, plus a call's overhead. On a GPU the
tile (128), the SMs and the rate come from the datasheet and one published layer (Korthikanti's
Table 4). Here they are fitted to measured matmuls of the shapes the layouts use (`shapes`: each
layer's q, k, v, proj and MLP matmuls, forward and both backward ones, and the head's, at several
micro-batches and TP degrees), plus `probes` whose sides are not multiples of 16 (the layouts' all
are, and a tile that divides every side costs nothing: only the probes can tell 8 from 16 or 1),
with the rank's threads as its SMs (one thread: a wave is one tile) and the measured copy rate
(bytes read and written) as its memory bandwidth:
  rate      FLOP/s of a full wave of tiles (fitted)
  tile      the tile's side, from TILES (the one that fits best; an exact tie goes to the larger)
  overhead  seconds a call costs besides: Python, dispatch, the BLAS's set-up (fitted, >= 0)
by robust least squares on log(predicted / measured) (a 5 us matmul counts as much as a 2 ms one; a
sample a busy host slowed weighs little), each sample the fastest of its calls. Measured here: a
tile of 8, about 100 GFLOP/s and 1.8-1.9 us a call with one thread; no shape is bound by memory,
so the roofline's floor is not tested on this CPU (`MatmulFit.memory_bound`).

The CPU cost model (cpu_time.py) does not time layers from this fit: it times the model's own
layer (layer_profile.py), in which Python and the elementwise kernels weigh as much as the matmuls
at these sizes. `layer_share` says how much of a profiled layer the fitted matmuls account for.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import least_squares

from minipar.planner import gpu_time
from minipar.planner.calibrate import fastest

TILES = (1, 4, 8, 16, 32, 64, 128)


def shapes(cfgs, micro_batches=(1, 2, 4), tps=(1, 2)) -> list[tuple[int, int, int]]:
    """Every distinct (m, n, k) that a layer and the head of these models compute, forward (m, n,
    k) and backward (m, k, n) and (n, k, m), at these micro-batches and TP degrees."""
    out = set()
    for cfg in cfgs:
        for b in micro_batches:
            for t in (t for t in tps if cfg.n_head % t == 0):
                head = (b * cfg.seq_len, cfg.vocab_size // t, cfg.d_model)
                for shape in gpu_time.layer_matmuls(cfg, b, t) + [head]:
                    out |= set(gpu_time.passes(*shape))
    return sorted(out)


def probes(cfgs) -> list[tuple[int, int, int]]:
    """Shapes beside the layouts' whose output sides are not multiples of 16, (b s + d, h + d, h)
    for d in 1, 4, 8, 12: the layouts' sides all are, so only these can tell a tile of 16 from a
    smaller one (a tile of t makes a side of 16 + d cost as much as the next multiple of t)."""
    return sorted({(b * cfg.seq_len + d, cfg.d_model + d, cfg.d_model) for cfg in cfgs
                   for b in (1, 2) for d in (1, 4, 8, 12)})


@dataclass(frozen=True)
class MatmulFit:
    """The fitted model (module docstring) and the samples it was fitted to."""
    rate: float
    tile: int
    overhead: float
    bandwidth: float          # bytes/s, the measured copy rate
    threads: int              # the SMs of the model
    samples: tuple            # ((m, n, k), measured seconds), fp32

    def work(self, b: int = 1, t: int = 1) -> gpu_time.Work:
        """A gpu_time.Work that times fp32 matmuls on this CPU (the fields matmul reads)."""
        return gpu_time.Work(b, t, False, "none", 4, self.rate, self.bandwidth, None, False, False,
                             self.threads, self.tile, self.overhead)

    def predict(self, m: int, n: int, k: int) -> float:
        return gpu_time.matmul(m, n, k, self.work())

    def errors(self, samples=None) -> list[float]:
        """predicted / measured - 1 of each of `samples` ((m, n, k), seconds); its own if None."""
        return [self.predict(*shape) / s - 1 for shape, s in samples or self.samples]

    def memory_bound(self, m: int, n: int, k: int) -> bool:
        """Whether its bytes at memory speed, not its tiles, set this matmul's time."""
        return self.predict(m, n, k) > gpu_time.matmul(m, n, k, dataclasses.replace(self.work(),
                                                                                  hbm=math.inf))


def fit(samples, threads: int, bandwidth: float, tiles=TILES, overhead: bool = True) -> MatmulFit:
    """The rate, tile and overhead (0 if not `overhead`) that fit these ((m, n, k), seconds)
    samples best, on log(predicted / measured)."""
    measured = np.log([s for _, s in samples])
    flops = max(2 * m * n * k / s for (m, n, k), s in samples)  # the start: the fastest rate seen
    best = None
    for tile in sorted(tiles, reverse=True):
        def model(x):
            rate, over = math.exp(x[0]), (x[1] * 1e-6 if overhead else 0.0)
            w = MatmulFit(rate, tile, over, bandwidth, threads, ()).work()
            return np.log([gpu_time.matmul(*shape, w) for shape, _ in samples]) - measured
        res = least_squares(model, [math.log(flops), 1.0], bounds=([0.0, 0.0], [math.inf, 1e3]),
                            loss="soft_l1", f_scale=0.05)  # a sample a busy host slowed: an outlier
        if best is None or res.cost < best[0] * (1 - 1e-3):
            best = (res.cost, tile, res.x)
    _, tile, x = best
    return MatmulFit(math.exp(x[0]), tile, x[1] * 1e-6 if overhead else 0.0, bandwidth, threads,
                     tuple(samples))


@functools.lru_cache(maxsize=16)
def fit_matmuls(cfgs: tuple, threads: int, micro_batches=(1, 2, 4), tps=(1, 2),
                reps: int = 15) -> MatmulFit:
    """Time every matmul of `shapes(cfgs, ...)` and `probes(cfgs)` here with `threads` threads
    (fp32, the fastest of `reps`: calibrate.fastest), and the copy rate of 32 MiB, and `fit` them.
    Cached per process."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        samples = []
        for m, n, k in shapes(cfgs, micro_batches, tps) + probes(cfgs):
            a, b = torch.randn(m, k), torch.randn(k, n)
            samples.append(((m, n, k), fastest(lambda: a @ b, reps)))
        x, y = torch.empty(2 ** 23), torch.empty(2 ** 23)
        copy = 2 * x.numel() * 4 / fastest(lambda: y.copy_(x), 7)  # bytes read and written
    finally:
        torch.set_num_threads(before)
    return fit(samples, threads, copy)


def layer_share(cfg, b: int, t: int, mm: MatmulFit, profiled: float) -> float:
    """The fraction of a profiled layer's forward + backward (`profiled` seconds) that the fitted
    matmuls of that layer take: forward, input gradients and weight gradients (no attention core:
    SDPA fuses it)."""
    return sum(gpu_time.dense_times(gpu_time.layer_matmuls(cfg, b, t), mm.work(b, t))) / profiled
