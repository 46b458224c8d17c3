"""The planner: a layout's step time and memory on a cluster (`estimate`), and a search over layouts (`plan`).

    step      = makespan of the pipeline schedule, simulated by `pipeline.simulate` with each chunk's
                F, B, W costs (gpu_time.py) and each message's p2p time  +  exposed DP/ZeRO time  +  optimizer
    breakdown = the busiest pipeline rank's compute, recompute, memory_bound, tp_comm (its busy time)
                + bubble (makespan with free messages - busy) + pp_p2p (what the messages add)
                + dp_comm + optimizer; the terms sum to the step time
    FLOPs     model FLOPs, Korthikanti et al. 2022 eq. 7: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) a step
                (recomputation not counted: that would be hardware FLOPs);
                tflops_per_gpu = FLOPs / step / world,  mfu = FLOPs / step / (world * peak)
    memory    per GPU of each pipeline stage (the fullest one reported, by category as memory.predict):
                params, grads, optimizer: the stage's parameters (tp_params' split, its chunks only)
                  under ZeRO over dp, padded as zero.py pads (equal to memory.predict when pp = 1)
                activations: memory.activations per layer (TP, SP, recompute; 16-bit unless fp32),
                  times the micro-batches the schedule keeps in flight on that rank (walked from the
                  schedule's own actions: an F adds its chunk, the chunk's last backward op frees it),
                  + the token ids on the first chunk, the head and loss on the last
                comm: DP buckets or ZeRO's gathered units, as memory.predict counts them

`global_batch` and `micro_batch` count sequences: each pipeline runs m = global_batch / (dp * micro_batch)
micro-batches (par.microbatches is replaced by it). A layout may use fewer GPUs than the cluster has (the
first par.world ranks); `plan` always uses them all.

Checked against Korthikanti et al. 2022 Table 5 (A100s, t = 8, SP; one efficiency, 0.69, from their
Table 4; tests/test_planner.py), seconds a step, predicted / published:
    SP + selective   22B 1.04 / 1.10 (-5%)   175B 13.6 / 13.75 (-1%)   530B 41.2 / 37.83 (+9%)   1T 77.5 / 71.49 (+8%)
    full recompute   22B 1.33 / 1.42 (-7%)   175B 17.8 / 18.13 (-2%)   530B 53.7 / 49.05 (+10%)  1T 101 / 94.42 (+7%)
The sign flips with size: the larger the matrices, the closer to peak Megatron's matmuls ran, which one
efficiency cannot follow (the 530B and 1T last stages also carry the logits, 7-8% of their work).

Heterogeneous clusters (`Cluster.mixed`): ranks are numbered part after part, so with pp > 1 the
stages (outermost in the grid) land on different GPU kinds, and with pp = 1 the DP replicas do.
A chunk gets layers in proportion to its GPUs' matmul rate (largest remainder, at least one), moved
one at a time from a stage that overflows its memory to the one with the most room; a DP replica
gets micro-batches in proportion to its rate. The step is the slowest replica's.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from minipar import memory, pipeline
from minipar.config import ParallelConfig
from minipar.planner.cluster import Cluster, GiB
from minipar.planner.gpu_time import (
    Work,
    chunk_cost,
    chunk_params,
    chunk_units,
    dp_time,
    optimizer_time,
    p2p,
    stage_memory,
)

TERMS = ("compute", "recompute", "memory_bound", "tp_comm", "bubble", "pp_p2p", "dp_comm", "optimizer")


@dataclass
class Estimate:
    cfg: object
    par: ParallelConfig
    cluster: Cluster
    global_batch: int
    micro_batch: int
    memory: dict                       # {category: bytes} on the fullest GPU
    capacity: float                    # that GPU's memory_per_gpu
    layers: tuple                      # layers per model chunk (global chunk order)
    shares: tuple                      # micro-batches per DP replica
    stages: list = field(default_factory=list)  # {category: bytes} of each pipeline rank's GPUs
    step_time: float = math.nan
    breakdown: dict = field(default_factory=dict)
    model_flops: float = 0.0

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.total_memory <= self.capacity

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time / self.par.world / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time / (self.par.world * self.cluster.peak_total / self.cluster.world)

    @property
    def label(self) -> str:
        p = self.par
        sched = f" {p.schedule}" + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "") if p.pp > 1 else ""
        return (f"dp{p.dp} tp{p.tp} pp{p.pp}{sched} b{self.micro_batch} zero{p.zero}"
                f"{' sp' if p.sequence_parallel else ''} rc={p.recompute}")

    def __repr__(self):
        return (f"Estimate({self.label}: {self.step_time:.4g} s, {self.tflops_per_gpu:.0f} TFLOP/s, "
                f"MFU {self.mfu:.1%}, {self.total_memory / GiB:.1f} GiB)")


def _ranks(par, stage=None, replica=None) -> list[int]:
    """Global ranks of a stage's block (all replicas), a replica (all stages), or one (stage, replica)
    TP group, in minipar's (pp, dp, tp) grid."""
    stages = range(par.pp) if stage is None else [stage]
    replicas = range(par.dp) if replica is None else [replica]
    return [(i * par.dp + j) * par.tp + k for i in stages for j in replicas for k in range(par.tp)]


def _proportional(total: int, weights: list[float], unit: int = 1) -> list[int]:
    """`total` split in proportion to `weights`, in multiples of `unit`, each at least one unit
    (largest remainder; ties to the first)."""
    n = total // unit
    raw = [n * w / sum(weights) for w in weights]
    out = [max(1, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))
    for i in order[:max(0, n - sum(out))]:
        out[i] += 1
    while sum(out) > n:  # the minimum of one pushed us over: take from the largest
        out[out.index(max(out))] -= 1
    return [unit * x for x in out]


def _validate(cfg, par, cluster, global_batch: int, micro_batch: int) -> ParallelConfig:
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    if not isinstance(global_batch, int) or global_batch % (par.dp * micro_batch):
        raise ValueError(f"global_batch ({global_batch}) must divide by dp * micro_batch "
                         f"({par.dp} * {micro_batch})")
    m = global_batch // (par.dp * micro_batch)  # replaces par.microbatches: the batch sizes decide it
    if par.world > cluster.world:
        raise ValueError(f"the layout needs dp * tp * pp = {par.world} GPUs, the cluster has {cluster.world}")
    par = par.replace(microbatches=m, schedule=par.schedule if par.pp > 1 else "1f1b")
    par.check(cfg, global_batch)
    return par


def _layout(cfg, par, cluster, global_batch, micro_batch, attention):
    """Validate, split layers and micro-batches, and size the memory: everything but the time."""
    if attention not in ("flash", "materialized"):
        raise ValueError(f"attention must be 'flash' or 'materialized', got {attention!r}")
    par = _validate(cfg, par, cluster, global_batch, micro_batch)
    p, chunks = par.pp, par.pp * par.virtual_stages
    speed = [cluster.rate(_ranks(par, stage=r), par.precision) for r in range(p)]
    layers = _proportional(cfg.n_layer, [speed[c % p] for c in range(chunks)])
    unit = p if par.schedule == "interleaved-1f1b" else 1
    shares = _proportional(par.dp * par.microbatches, [cluster.rate(_ranks(par, replica=j), par.precision)
                                                       for j in range(par.dp)], unit)
    capacity = [min(cluster.device(x).memory_per_gpu for x in _ranks(par, stage=r)) for r in range(p)]
    mem = stage_memory(cfg, par, micro_batch, max(shares), layers, attention == "materialized")
    for _ in range(cfg.n_layer if cluster.groups else 0):  # heterogeneous: move layers out of full stages
        free = [capacity[r] - sum(mem[r].values()) for r in range(p)]
        worst, best = free.index(min(free)), free.index(max(free))
        donor = next((c for c in range(worst, chunks, p) if layers[c] > 1), None)
        if free[worst] >= 0 or donor is None or worst == best:
            break
        layers[donor] -= 1
        layers[min(range(best, chunks, p), key=lambda c: layers[c])] += 1
        mem = stage_memory(cfg, par, micro_batch, max(shares), layers, attention == "materialized")
    fullest = max(range(p), key=lambda r: sum(mem[r].values()) / capacity[r])
    return Estimate(cfg, par, cluster, global_batch, micro_batch, mem[fullest], capacity[fullest],
                    tuple(layers), tuple(shares), mem, model_flops=global_batch * cfg.seq_len * cfg.flops_per_token)


@functools.lru_cache(maxsize=4096)
def _simulate(name: str, p: int, m: int, v: int, F: tuple, B: tuple, W: tuple, latency: float):
    """(makespan, busy per rank) of a schedule; costs are normalised by the caller so that layouts with
    the same proportions share one simulation."""
    cost = {"F": list(F), "B": list(B), "W": list(W)}
    tl = pipeline.simulate(memory.schedule_actions(name, p, m, v), p, m, v, cost=cost, latency=latency)
    return tl.makespan, tl.busy


def _pipeline_time(par, costs: list[dict], m: int, latency: float):
    """(makespan with messages, makespan without, busiest rank) of one replica's pipeline."""
    per_op = {op: [sum(c[op].values()) for c in costs] for op in ("F", "B", "W")}
    u = max(per_op["F"]) or 1.0
    norm = {op: tuple(round(x / u, 9) for x in xs) for op, xs in per_op.items()}
    args = (par.schedule, par.pp, m, par.virtual_stages, norm["F"], norm["B"], norm["W"])
    free, busy = _simulate(*args, 0.0)
    with_msgs = _simulate(*args, round(latency / u, 9))[0] if par.pp > 1 else free
    return u * with_msgs, u * free, max(range(par.pp), key=lambda r: busy[r])


def _replica_time(cfg, est: Estimate, j: int, attention: str) -> tuple[float, dict, list]:
    """Seconds of DP replica j's pipeline, its breakdown, and each chunk's per-micro-batch costs."""
    par, cluster, b, m = est.par, est.cluster, est.micro_batch, est.shares[j]
    p, chunks, e = par.pp, len(est.layers), 4 if par.precision == "fp32" else 2
    costs = []
    for c, n in enumerate(est.layers):
        ranks = _ranks(par, stage=c % p, replica=j)
        w = Work(b, par.tp, par.sequence_parallel, par.recompute, e, cluster.rate(ranks, par.precision),
                 min(cluster.device(x).memory_bandwidth for x in ranks), cluster.link(ranks),
                 par.schedule == "zb-h1", attention == "materialized")
        costs.append(chunk_cost(cfg, w, n, c == 0, c == chunks - 1))
    message = b * cfg.seq_len * cfg.d_model * e / (par.tp if par.sequence_parallel else 1)
    latency = p2p(message, cluster.link(_ranks(par, replica=j)[::par.tp]))
    with_msgs, free, r = _pipeline_time(par, costs, m, latency)
    mine = [costs[c] for c in range(r, chunks, p)]
    terms = {k: m * sum(c[op].get(k, 0.0) for c in mine for op in c) for k in TERMS[:4]}
    terms.update(bubble=max(0.0, free - sum(terms.values())), pp_p2p=max(0.0, with_msgs - free))
    return with_msgs, terms, costs


def _step(cfg, est: Estimate, attention: str) -> Estimate:
    par, cluster, p = est.par, est.cluster, est.par.pp
    if cluster.cpu is not None:  # local CPU ranks: the measured model of cpu_time.py
        from minipar.planner import cpu_time
        est.step_time, est.breakdown = cpu_time.step_time(cfg, est)
        return est
    replicas = {}
    for j, m in enumerate(est.shares):  # identical replicas (same share, same GPUs) are timed once
        key = (m, tuple(cluster.device(x).name for x in _ranks(par, replica=j)))
        replicas.setdefault(key, _replica_time(cfg, est, j, attention))
    span, terms, costs = max(replicas.values(), key=lambda x: x[0])
    per, chunks = memory.layout_bytes(par.precision), len(est.layers)
    dp = opt = 0.0
    for r in range(p):
        mine = [c for c in range(r, chunks, p)]
        psi = sum(chunk_params(cfg, par.tp, est.layers[c], c == 0, c == chunks - 1) for c in mine)
        backward = sum(v for c in mine for op in ("B", "W") for v in costs[c][op].values())
        compute = backward + sum(costs[c]["F"].get("compute", 0.0) for c in mine)
        units = sum(len(chunk_units(cfg, par.tp, est.layers[c], c == 0, c == chunks - 1)) for c in mine)
        dp = max(dp, dp_time(par, psi, per, cluster.link(_ranks(par, stage=r)[::par.tp]), backward, compute, units))
        hbm = min(cluster.device(x).memory_bandwidth for x in _ranks(par, stage=r))
        opt = max(opt, optimizer_time(psi / (par.dp if par.zero else 1), per, hbm))
    est.breakdown = {**terms, "dp_comm": dp, "optimizer": opt}
    est.step_time = span + dp + opt
    return est


def estimate(cfg, par: ParallelConfig, cluster: Cluster, global_batch: int, micro_batch: int = 1,
             attention: str = "flash") -> Estimate:
    """Predicted memory (fullest GPU) and step time of layout `par` on `cluster` (module docstring).
    attention: "flash" (minipar's fused SDPA: no attention matrix in memory) or "materialized"
    (Megatron-LM in 2022: the a s^2 b scores written, softmaxed and dropped out in memory; the activations
    then hold Korthikanti's 5 a s^2 b / t bytes a layer more when nothing is recomputed)."""
    return _step(cfg, _layout(cfg, par, cluster, global_batch, micro_batch, attention), attention)
