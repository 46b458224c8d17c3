"""This machine as a Cluster: what its CPU cores and gloo give
`world` local ranks, measured in seconds.

gpu_time.py models GPUs: kernels queued ahead of the host, collectives on links of their own,
overlapped with compute. minipar's small models on a few CPU cores live elsewhere: a layer is mostly
Python and dispatch, ranks time-share the cores once there are more ranks than cores, and a
collective waits for its peers to be woken and scheduled. So, as planners that profile before they
plan do (Galvatron, Alpa), we time the pieces a step is made of on this machine: the machine here,
the model's own layer in layer_profile.py, and cpu_time.py adds them up.

`measure(world)`: one minipar.launch of `world` ranks, each with the intra-op threads launch gives
it (max(1, cores // world): `threads`; `cores`: those this process may run on). Rank 0 alone, first:
  matmul      FLOP/s of a 512^3 fp32 matmul, fastest of 7: the rate of one rank (the Cluster's
              peak_flops, the MFU denominator; step times come from the profile, not from it)
  copy_rate   bytes/s of a 32 MiB copy, fastest of 7 (ZeRO's flat buffers)
Then the probes, every rank at once (`link_rank`; `run_layouts` repeats them before each layout, and
`with_links` takes the median of each figure over all the probes of a run):
  share       a rank's speed with every rank busy over its speed alone: a micro-step of the tiny GPT
              (b 2), the median of 9 on rank 0 alone over the mean of a ~0.3 s window with every
              rank looping. Time-sharing alone gives min(1, slots / world), slots = cores //
              threads; `sharing` is what is left of that (below 1 when a virtual machine's cores are
              slower with both busy)
  links       per group size g (2, 4, 8 dividing world; every rank in a group of g at once), each
              cycle timed as the mean over a ~0.15 s window:
                meet       what ranks pay to meet in a collective when they come from compute (a
                           woken process, a peer not yet there): (~0.3 ms of matmuls +
                           comm.all_reduce of 1 KiB)
                           - (the matmuls alone) - (the all-reduce back to back)
                step       seconds a ring step of back-to-back 1 KiB all-reduces: their time
                           / 2(g-1)
                bandwidth  2 (g-1) / g MiB over the time a 1 MiB all-reduce adds to a 1 KiB one
`this_machine(world)` is this machine as a Cluster (`cluster_of`); it reads the calibration from a
JSON file under the temporary directory, keyed by host, cores, torch version and world, or measures
and writes it there if there is none (or `refresh=True`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minipar import comm
from minipar.launch import cores, launch
from minipar.model import GPTConfig
from minipar.planner.cluster import Cluster, GiB
from minipar.planner.layer_profile import micro_step
from minipar.train import train_layouts


@dataclass(frozen=True)
class CPU:
    """What `world` local ranks get from this machine (module
    docstring). Frozen: a Cluster field."""
    world: int
    cores: int            # the cores this process may run on
    threads: int          # intra-op threads per rank (launch: max(1, cores // world))
    matmul: float         # FLOP/s of one rank
    copy_rate: float      # bytes/s
    share: float = 1.0    # a rank's speed while every rank runs a micro-step, over its speed alone
    links: tuple = ()     # (group size, meet s, s a ring step, bytes/s), per group size measured
    measured_at: float = 0.0  # when, time.time() (0: not known)
    slowdown: float = 1.0     # an emulated kind (`emulate`): each compute then sleeps
                              #   (slowdown - 1) times its time (hardware.throttle)

    def link(self, n: int) -> tuple[float, float, float]:
        """(s to meet after compute, s a ring step, bandwidth) among n ranks:
        the nearest group size measured."""
        if not self.links:
            return 0.0, 0.0, float("inf")
        return min(self.links, key=lambda x: (abs(x[0] - n), x[0]))[1:]

    @property
    def slots(self) -> int:
        """Ranks that can compute at once at full speed: cores // threads (at least 1)."""
        return max(1, self.cores // self.threads)

    @property
    def sharing(self) -> float:
        """How much of its cores' time-sharing the ranks get: `share` over min(1, slots / world), at
        most 1. 1 on a quiet machine (2 processes of matmuls on 2 cores each run at full speed, 4 at
        half); below when the cores are slower with every rank busy (a virtual machine's cores
        shared on its host)."""
        return min(1.0, self.share / min(1.0, self.slots / self.world))


# ----------------------------------------------------------------------------- timing


def _times(fn, reps: int, warmup: int = 2, budget: float = 2.0) -> list[float]:
    """Seconds of `reps` runs of fn after `warmup` (fewer if they
    pass `budget` seconds, at least 3)."""
    for _ in range(warmup):
        fn()
    times, end = [], time.perf_counter() + budget
    for i in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if start > end and i >= 2:
            break
    return times


def fastest(fn, reps: int) -> float:
    """The fastest of `times`: other work on a shared machine only ever adds time."""
    return min(_times(fn, reps))


# ----------------------------------------------------------------------------- the machine


def machine_rank(reps: int = 7) -> dict:
    """Rank 0's part of `measure`, the other ranks waiting (module docstring);
    {"world", "threads"} elsewhere."""
    out = {"world": dist.get_world_size(), "threads": torch.get_num_threads()}
    if dist.get_rank() == 0:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        x, y = torch.empty(2 ** 23), torch.empty(2 ** 23)
        out.update(matmul=2 * 512 ** 3 / fastest(lambda: a @ b, reps),
                   copy_rate=x.numel() * 4 / fastest(lambda: y.copy_(x), reps))
    dist.barrier()
    return out


def probe_groups() -> dict:
    """{group size g: this rank's group of g consecutive ranks}, for g in 2, 4, 8 dividing the
    world, and 2 in any world of 2 or more (an odd world's last rank in none: None). The groups
    `link_rank` probes. Collective: every rank calls it (each must make every group)."""
    rank, world, out = dist.get_rank(), dist.get_world_size(), {}
    for g in (g for g in (2, 4, 8) if world % g == 0 or g == 2 <= world):
        groups = [dist.new_group(list(range(i, i + g))) for i in range(0, world - g + 1, g)]
        out[g] = groups[rank // g] if rank // g < len(groups) else None
    return out


def _cycle(work, collective=None, seconds: float = 0.3) -> float:
    """Mean seconds of `work` then `collective()` (either may be None) on this rank, over a window
    of about `seconds` with every rank doing the same: long beside the scheduler's time slices, so
    that time-sharing is averaged in. Rank 0 decides every 20 rounds whether to go on, so that the
    ranks run as many rounds."""
    n, go = 0, torch.ones(1)
    dist.barrier()
    start = time.perf_counter()
    while go.item():
        for _ in range(20):
            if work is not None:
                work()
            if collective is not None:
                collective()
        n += 20
        go.fill_(float(time.perf_counter() - start < seconds))
        dist.broadcast(go, 0)
    return (time.perf_counter() - start) / n


def link_rank(seconds: float = 0.15, groups: dict | None = None) -> dict:
    """The probes on every rank (module docstring): {"alone", "together": seconds of a micro-step of
    the tiny GPT, rank 0 alone and every rank at once; g: (all-reduce of 1 KiB after ~0.3 ms of
    matmuls, ~0.3 ms of matmuls alone, all-reduce of 1 KiB back to back, of 1 MiB back to back) per
    group size g}.
    groups: `probe_groups()`, made once by a worker that probes several times (here if None)."""
    groups = probe_groups() if groups is None else groups
    step = micro_step(GPTConfig.preset("tiny"), 2, 1, False, "none", "fp32", "plain")
    step()
    dist.barrier()
    out = {"alone": statistics.median(_times(step, 9)) if dist.get_rank() == 0 else 0.0}
    out["together"] = _cycle(step, None, 2 * seconds)
    a, w = torch.randn(128, 64), torch.randn(64, 256)
    # ~0.3 ms of matmuls, rank 0's
    count = torch.tensor([max(1, round(3e-4 / fastest(lambda: a @ w, 9)))])
    dist.broadcast(count, 0)

    def work():
        for _ in range(int(count)):
            a @ w

    small, big = torch.zeros(256), torch.zeros(2 ** 18)
    for g, group in groups.items():  # a rank in no group of g runs the cycles (they are
        # collective), its collective a no-op, and reports None
        reduce = (lambda x: None) if group is None else (lambda x: comm.all_reduce(x, group))
        cycles = (_cycle(work, lambda: reduce(small), seconds), _cycle(work, None, seconds),
                  _cycle(None, lambda: reduce(small), seconds / 2),
                  _cycle(None, lambda: reduce(big), seconds / 2))
        out[g] = cycles if group is not None else None
    return out


def calibrate_rank(reps: int = 7) -> dict:
    """The worker `measure` launches on every rank: `machine_rank`, then `link_rank`."""
    return {"machine": machine_rank(reps), "links": link_rank()}


def with_links(cpu: CPU | None, probes: list[dict], machine: dict | None = None) -> CPU:
    """`cpu` with the links that `probes` give (`link_rank` results, of every rank and of one or
    more rounds), each figure the median over them; a new CPU from rank 0's `machine_rank` result if
    cpu is None."""
    links = []
    for g in (g for g in probes[0] if isinstance(g, int)):
        after, work, tight, big = (statistics.median(p[g][i] for p in probes if p[g])
                                   for i in range(4))
        steps = 2 * (g - 1)
        links.append((g, max(after - work - tight, 0.0), tight / steps,
                      steps * 2 ** 20 / g / max(big - tight, 1e-9)))
    alone = statistics.median(p["alone"] for p in probes if p["alone"])
    load = dict(links=tuple(links),
                share=min(1.0, alone / statistics.median(p["together"] for p in probes)))
    if cpu is not None:
        return dataclasses.replace(cpu, **load)
    return CPU(cores=len(cores()), **load, **machine)


def measure(world: int, reps: int = 7, timeout: float = 120.0) -> CPU:
    """Measure this machine for `world` local ranks (module docstring):
    one launch, a few seconds."""
    ranks = launch(calibrate_rank, world, reps, backend="gloo", timeout=timeout)
    return dataclasses.replace(with_links(None, [r["links"] for r in ranks], ranks[0]["machine"]),
                               measured_at=time.time())


# ----------------------------------------------------------------------------- the cache


def _cache_path(world: int) -> str:
    key = f"{platform.node()}-{len(cores())}-{torch.__version__}-{world}".replace(os.sep, "_")
    return os.path.join(tempfile.gettempdir(), "minipar-calibration", f"{key}.json")


def _read(world: int) -> CPU | None:
    """The calibration cached for `world` ranks in the temporary directory, or None."""
    try:
        with open(_cache_path(world)) as f:
            d = json.load(f)
        d["links"] = [tuple(x) for x in d["links"]]
        return CPU(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    except (OSError, ValueError, TypeError, KeyError):
        return None  # no cache, or a stale or broken one: measure again


def _write(cpu: CPU) -> None:
    path = _cache_path(cpu.world)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(cpu), f)


def this_machine(world: int = 1, refresh: bool = False, max_age: float = 3600.0) -> Cluster:
    """This machine's CPU cores as a Cluster of `world` local ranks: the calibration cached in the
    JSON file (`_cache_path`), or, if there is none, it is older than `max_age` seconds (what else
    runs here changes: an hour-old share of the cores predicts today's steps badly) or `refresh`,
    measured and written there."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    cpu = None if refresh else _read(world)
    if cpu is None or time.time() - cpu.measured_at > max_age:
        cpu = measure(world)
        _write(cpu)
    return cluster_of(cpu)


def cluster_of(cpu: CPU) -> Cluster:
    """A Cluster of cpu.world local ranks from a CPU calibration: per rank the memory available now
    divided by world, the measured matmul rate of one rank as its peak (the MFU denominator), the
    measured gloo link of two ranks. Step times come from cpu_time.py, not these."""
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        free = 4 * GiB
    _, latency, bandwidth = cpu.link(2)
    link = dict(intra_bandwidth=min(bandwidth, 1e12), intra_latency=latency,
                inter_bandwidth=min(bandwidth, 1e12), inter_latency=latency)
    return Cluster(gpus_per_node=cpu.world, nodes=1, memory_per_gpu=free / cpu.world,
                   peak_flops=cpu.matmul,
                   efficiency=1.0, memory_bandwidth=cpu.copy_rate, name=f"this-cpu-x{cpu.world}",
                   cpu=cpu, **link)


def emulate(machine: Cluster, kinds) -> Cluster:
    """A mixed cluster of device kinds emulated by this machine's ranks (`this_machine`'s Cluster
    of their total world): kinds = [(name, ranks, slowdown, memory bytes)], in rank order. A kind
    computes `slowdown` (>= 1) times slower, by the throttle that sleeps after each compute
    (hardware.throttle), so its peak is the machine's over slowdown and cpu_time replays the sleeps;
    `memory` is its capacity, all of it usable (the check of the planned bytes, not an allocator's).
    Sleeping frees the core, but ranks that compute at the same moment share the cores: the
    emulated kinds are what they say with one rank a core (more ranks slow each other, which
    cpu_time's time-sharing replays)."""
    kinds = list(kinds)
    if sum(n for _, n, _, _ in kinds) != machine.world:
        raise ValueError(f"the kinds have {sum(n for _, n, _, _ in kinds)} ranks, the machine's "
                         f"calibration {machine.world}")
    if any(not f >= 1.0 for _, _, f, _ in kinds):
        raise ValueError(f"slowdowns must be >= 1 (times slower), got {[k[2] for k in kinds]}")
    return Cluster.mixed(dataclasses.replace(
        machine, gpus_per_node=n, nodes=1, name=name, memory_per_gpu=memory, usable=1.0,
        peak_flops=machine.peak_flops / f, cpu=dataclasses.replace(machine.cpu, slowdown=f))
        for name, n, f, memory in kinds)


# ----------------------------------------------------------------------- many layouts, one launch


def _system_busy() -> float:
    """Seconds of CPU time every program on this machine has used so
    far (Linux /proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int,
                                                                        f.readline().split()[1:9])
        return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return 0.0


def run_layouts(jobs: list, steps: int, calibrate: bool = False) -> dict:
    """Worker: train each (cfg, ParallelConfig, global_batch) of `jobs` (all of this world's size)
    for `steps` steps with `train_layouts`, one after the other in this one job, with the threads
    launch gave. calibrate: first `machine_rank`, and `link_rank` right before each layout. Returns
    this rank's {"machine": {...}, "layouts": [{"step_times": [s], "memory": {category: bytes},
    "calls": {collective: calls over the steps}, "peak": the watched step's held peak (TrainResult.
    step_peak's "held"), "links": {...}, "others": cores other programs kept busy meanwhile (rank
    0; None elsewhere)}]}."""
    out = {"machine": machine_rank() if calibrate else None, "layouts": []}
    groups = probe_groups() if calibrate else None  # once per job: every rank makes every group

    def probed(i: int, train):  # train_layouts' hook around layout i: the probes and the clocks
        links = link_rank(groups=groups) if calibrate else None
        dist.barrier()
        wall, cpu, busy = time.perf_counter(), time.process_time(), _system_busy()
        r = train()
        ours = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
        dist.all_reduce(ours)  # every rank's CPU seconds, all threads: what is
                               #   not ours is other programs'
        wall, others = time.perf_counter() - wall, _system_busy() - busy - ours.item()
        out["layouts"].append({"step_times": r.step_times, "memory": r.memory, "calls": r.calls,
                               "peak": r.step_memory.get("held"),
                               "links": links,
                               "others": max(others, 0.0) / wall if dist.get_rank() == 0 else None})
        return r

    layouts = [dict(cfg=cfg, par=par, global_batch=b) for cfg, par, b in jobs]
    train_layouts(layouts, around=probed, steps=steps)
    return out
