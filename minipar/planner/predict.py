"""The planner: a layout's step time and memory on a cluster (`estimate`), and a search over
layouts (`plan`).

    step      = makespan of the pipeline schedule, simulated by `pipeline.simulate` with each
                chunk's F, B, W costs (gpu_time.py) and its messages (gpu_time.messages: between
                the ops, or in them where they block) + exposed DP/ZeRO time + optimizer
    breakdown = the busiest pipeline rank's compute, recompute, memory_bound, tp_comm, cp_comm,
                ep_comm (its busy time) + bubble (makespan with free messages - busy) + pp_p2p
                (what the messages add) + dp_comm + optimizer; the terms sum to the step time
    FLOPs     model FLOPs a step, B s cfg.flops_per_token (Korthikanti et al. 2022 eq. 7 for GPT-2
                shapes; recomputation not counted: that would be hardware FLOPs);
                tflops_per_gpu = FLOPs / step / world,  mfu = FLOPs / step / (world * peak)
    memory    per GPU of each pipeline stage (the fullest one reported), by category as
              memory.predict gives them:
                params, grads, optimizer: the stage's parameters (tp_params' split, its chunks only)
                  under ZeRO over dp, padded as zero.py pads (equal to memory.predict when pp = 1)
                activations: memory.activations per layer (TP, SP, recompute; 16-bit unless fp32),
                  times the micro-batches the schedule keeps in flight on that rank (walked from the
                  schedule's own actions: an F adds its chunk, the chunk's last backward op frees
                  it), + the token ids on the first chunk, the head and loss on the last
                comm: DP buckets or ZeRO's gathered units, as memory.predict counts them
                (`stage_memory`: memory.rank_states of each rank's memory.rank_units, and
                memory.pipeline_activations over the schedule); `Estimate.peak` adds the
                step's transients, `fits` keeps the allocator's reserve (Cluster.usable)
    timeline  the slowest replica's pipeline as simulated, in seconds (`Estimate.timeline`):
                what the lessons draw, never recomputed

`global_batch` and `micro_batch` count sequences: each pipeline runs m = global_batch / (dp *
micro_batch) micro-batches (par.microbatches is replaced by it). A layout may use fewer GPUs than
the cluster has (the first par.world ranks); `plan` always uses them all. `estimate` is
`split_layout` (validate, split layers and micro-batches, size the memory) then `time_layout` (the
step time); `plan` runs the second only on layouts that fit. `time_layout` is the one place that
chooses the time model: a Cluster with a CPU calibration is timed by cpu_time.py, any other by
gpu_step.py (from gpu_time.py's costs).

Context and expert parallelism (GPUs of one kind, fused attention): a CP rank computes its s / cp
tokens of each sequence, its attention over all s keys, and its exchanges as context_parallel.py
makes them (gpu_time.cp_times); its DP and ZeRO run over dp x cp ranks. A MoE layer stays whole on
each TP rank; with expert parallelism a rank holds n / ep experts, each taking ep b s k / n rows of
an even routing, sends and receives the tokens' rows by all-to-all (gpu_time.ep_time), and
reduces its experts' gradients over dp / ep ranks after the rest. Their memory is memory.predict's
(the step's transients are not walked for them).

Heterogeneous clusters (`Cluster.mixed`): ranks are numbered part after part, so with pp > 1 the
stages (outermost in the grid) land on different GPU kinds, and with pp = 1 the DP replicas do.
The chunks' layers are the split whose slowest chunk is fastest (partition.min_max, dynamic
programming over the boundaries, from each chunk's time a layer on its GPUs and the ends), then
moved one at a time from a stage that overflows its memory to the one with the most room; a DP
replica gets micro-batches in proportion to its rate. From there `refine` searches: one layer or
one share of micro-batches moved at a time, while the step gets shorter under this model (bubble,
messages, DP time) and the stages fit. The step is the slowest replica's.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from minipar import memory, pipeline
from minipar.config import ParallelConfig
from minipar.mesh import layout_ranks
from minipar.planner import cpu_time
from minipar.planner.cluster import Cluster, flops_unit, memory_unit, rate_of
from minipar.planner.gpu_step import gpu_step
from minipar.planner.gpu_time import OVERLAPS, WHOSE
from minipar.planner.partition import chunk_seconds, min_max
from minipar.step_memory import stage_peaks



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
    # the slowest replica's pipeline as simulated (no DP or optimizer time), in `time_unit` seconds,
    # shared by layouts of the same proportions (`_simulate`); on a CPU, cpu_time's shared replay
    simulated: pipeline.Replay | pipeline.Timeline | None = field(default=None, repr=False)
    time_unit: float = 1.0
    attention: str = "flash"           # "flash" (fused SDPA) or "materialized" (Megatron 2022)
    overlap: str = "minipar"           # whose overlaps are timed: gpu_time.OVERLAPS
    peak: dict | None = None           # the step's peak with its transients (`_step_peaks`)
    float8: bool = False               # the linear layers' matmuls timed in float8 (a published
                                       #   run's: gpu_time.work_on; minipar trains in 16 bits)

    @functools.cached_property
    def timeline(self) -> pipeline.Timeline:
        """The simulated pipeline in seconds: what the lessons draw, never recomputed."""
        u, sim = self.time_unit, self.simulated
        events = sim.timeline().events if isinstance(sim, pipeline.Replay) else sim.events
        return pipeline.Timeline([[(a, u * s, u * e) for a, s, e in rank] for rank in events])

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def peak_memory(self) -> float:
        """The most the fullest GPU holds in a step: the peak with its transients where predicted
        (`peak`), else `total_memory` (model states and buffers, the activations at their most)."""
        return _most(self.memory, self.peak)

    @property
    def fits(self) -> bool:
        """Within `capacity`: the GPU's memory less the allocator's reserve (Cluster.usable)."""
        return self.peak_memory <= self.capacity

    @property
    def flops_per_gpu(self) -> float:
        return self.model_flops / self.step_time / self.par.world

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_gpu / 1e12

    @property
    def mfu(self) -> float:
        return self.flops_per_gpu / (self.cluster.peak_total / self.cluster.world)

    @property
    def label(self) -> str:
        p = self.par
        sched = (f" {p.schedule}" + f" v{p.virtual_stages}" * (p.virtual_stages > 1)) * (p.pp > 1)
        on = f" on {self.cluster.name}" if self.cluster.groups and p.pp > 1 else ""  # stage order
        tp = f"({','.join(map(str, p.stage_tp))})" if p.stage_tp else p.tp  # each stage's
        cp = f" cp{p.cp} {p.cp_method}" if p.cp > 1 else ""
        return (f"dp{p.dp}{cp}{f' ep{p.ep}' * (p.ep > 1)} tp{tp} pp{p.pp}{sched} "
                f"b{self.micro_batch} zero{p.zero}{' sp' if p.sequence_parallel else ''} "
                f"rc={p.recompute}{on}")

    def __repr__(self):
        flops, fname = flops_unit(self.flops_per_gpu)
        mem, mname = memory_unit(self.peak_memory)
        return (f"Estimate({self.label}: {self.step_time:.4g} s, {self.flops_per_gpu / flops:.3g} "
                f"{fname}, MFU {self.mfu:.1%}, {self.peak_memory / mem:.1f} {mname}; "
                f"{WHOSE[self.overlap]} overlaps)")


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
    m = global_batch // (par.dp * micro_batch)  # replaces par.microbatches: the batches decide
    if par.world > cluster.world:
        raise ValueError(f"the layout needs dp * cp * tp * pp = {par.world} GPUs, the cluster has "
                         f"{cluster.world}")
    par = par.replace(microbatches=m, schedule=par.schedule if par.pp > 1 else "1f1b")
    par.check(cfg, global_batch)
    return par


def stage_memory(cfg, par, b: int, layers: list[int], materialized: bool, per: dict, e: int,
                 actions: tuple, memo: dict | None = None) -> list[dict]:
    """{category: bytes} of a GPU of each pipeline rank: memory.rank_states of the units it holds
    (memory.rank_units; DP rank 0, the fullest) and the activation peak of its schedule `actions`
    (memory.pipeline_activations), at `per` bytes a parameter and `e` an activation element.
    memo: {(rank, its layers): its bytes} of this layout and schedule, filled here (a split's
    moves change two ranks' layers: the others are looked up)."""
    memo = {} if memo is None else memo
    held = [tuple(layers[r::par.pp]) for r in range(par.pp)]
    todo = [r for r in range(par.pp) if (r, held[r]) not in memo]
    if todo:
        kept = materialized and par.recompute == "none"  # Korthikanti's attention matrix, 5as^2b/t
        states = par.replace(recompute="none", microbatches=par.pp, schedule="interleaved-1f1b"
                             if par.virtual_stages > 1 else "1f1b")  # nor on these: one entry
    # a rank's peak is its own chunks': with stage_tp each stage's at its tp
    for t in {par.tp_at(r) for r in todo}:
        mine = [r for r in todo if par.tp_at(r) == t]
        extra = 5 * cfg.n_head * cfg.seq_len ** 2 * b // t if kept else 0
        peaks = memory.pipeline_activations(cfg, par.at_stage(mine[0]), b, e, list(layers),
                                            actions, extra, mine)
        for r, peak in zip(mine, peaks):
            memo[r, held[r]] = memory.by_category(_rank_states(
                cfg, states.at_stage(r), tuple(per.items()), r, held[r]), peak)
    return [memo[r, held[r]] for r in range(par.pp)]


@functools.lru_cache(maxsize=1 << 14)
def _rank_states(cfg, par, per: tuple, r: int, held: tuple) -> dict:
    """memory.rank_states of pipeline rank r (DP rank 0) whose chunks hold `held` layers. Cached:
    the planner sizes many splits of a layout, and moving a layer changes two ranks' states."""
    layers = [0] * (par.pp * par.virtual_stages)
    layers[r::par.pp] = held
    units, params = (memory.rank_units(cfg, par.tp, layers, par.pp, r, of=of)  # ZeRO-3's; buckets'
                     for of in (memory.chunk_units, memory.chunk_params))
    gathered = memory.zero3_gathered(cfg, par, r, layers) if par.zero == 3 else None
    return memory.rank_states(par, units, dict(per), 0, params, gathered)


def split_layout(cfg, par, cluster, global_batch: int, micro_batch: int, attention: str = "flash",
                 overlap: str = "minipar", exact: bool = True) -> Estimate:
    """Validate, split layers and micro-batches, and size the memory: an Estimate with everything
    but the time (`time_layout` adds it; `refine` then searches a mixed cluster's splits). exact=
    False (`plan`'s search) skips the walk of the step's transients where the counted tensors
    overflow already (no fit either way): most layouts of a big search; and on a mixed cluster it
    stops moving layers once every stage (of one chunk) overflows."""
    if attention not in ("flash", "materialized"):
        raise ValueError(f"attention must be 'flash' or 'materialized', got {attention!r}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {sorted(OVERLAPS)}, got {overlap!r}")
    if overlap == "deepspeed" and par.pp > 1 and (par.zero > 1 or par.schedule != "1f1b"):
        raise ValueError(f"DeepSpeed's pipeline engine runs 1F1B with ZeRO 0 or 1, not "
                         f"{par.schedule} with ZeRO {par.zero}")
    par = _validate(cfg, par, cluster, global_batch, micro_batch)
    if (par.cp > 1 or cfg.n_expert) and (cluster.groups or cluster.cpu or attention != "flash"):
        raise ValueError("the planner models context parallelism and experts on GPUs of one kind "
                         "with fused attention (not yet a mixed cluster, a CPU's measured layers "
                         "or materialised attention)")
    p, chunks, dp = par.pp, par.pp * par.virtual_stages, par.dp
    layers = min_max(cfg.n_layer, *chunk_seconds(cfg, par, cluster, micro_batch, attention)) \
        if cluster.groups else _proportional(cfg.n_layer, [1.0] * chunks)  # as partition() cuts
    # each replica's rate: Cluster.rate of its GPUs, from the parts its TP groups run on
    rates = [rate_of([g for parts in stages for g in parts], par.precision)
             for stages in cluster.tp_parts(dp, par.tp, p, par.stage_tp)]
    shares = _proportional(dp * par.microbatches, rates, _share_unit(par))
    memo = {}
    size = functools.lru_cache(None)(  # the moves below cycle when no split fits: size each once
        lambda layers: sized(cfg, par, cluster, global_batch, micro_batch, list(layers), shares,
                             attention, overlap, exact, memo))
    est = size(tuple(layers))
    caps = capacities(cluster, par)
    for _ in range(cfg.n_layer if cluster.groups else 0):  # mixed: layers out of full stages
        free = [c - sum(m.values()) for c, m in zip(caps, est.stages)]
        worst, best = free.index(min(free)), free.index(max(free))
        donor = next((c for c in range(worst, chunks, p) if layers[c] > 1), None)
        # every stage over (one chunk each): a rank's bytes grow with its layers, and any other
        # split gives some rank as many as now or more, so none fits (the search stops there)
        hopeless = not exact and par.virtual_stages == 1 and free[best] < 0
        if free[worst] >= 0 or donor is None or worst == best or hopeless:
            break
        layers[donor] -= 1
        layers[min(range(best, chunks, p), key=lambda c: layers[c])] += 1
        est = size(tuple(layers))
    return est


def _share_unit(par) -> int:
    """The micro-batches a DP replica's share comes in (interleaved 1F1B: multiples of pp)."""
    return par.pp if par.schedule == "interleaved-1f1b" else 1


@functools.lru_cache(maxsize=4096)
def capacities(cluster, par) -> tuple[float, ...]:
    """What each pipeline stage's counted tensors may fill: the smallest memory_per_gpu of its
    GPUs times their kind's `usable` fraction (the rest is the allocator's, the collectives' and
    the kernels' workspaces, and the CUDA context: Cluster.usable)."""
    stages = (cluster.parts_of(layout_ranks(par, r)) for r in range(par.pp))
    return tuple(min(g.memory_per_gpu * g.usable for g in parts) for parts in stages)


def sized(cfg, par, cluster, global_batch: int, micro_batch: int, layers, shares,
          attention: str = "flash", overlap: str = "minipar", exact: bool = True,
          memo: dict | None = None) -> Estimate:
    """The Estimate, untimed, of `par` (validated: `split_layout`'s) with these layers per chunk and
    micro-batches per replica: memory sized on every stage, the fullest at its peak (relative to
    its capacity) as `memory`. `time_layout` times any split, e.g. lesson 07's uniform one.
    memo: stage_memory's, for the splits of one layout and shares."""
    sizing = (attention == "materialized", memory.layout_bytes(par.precision, par.reduce_fp32),
              memory.element_bytes(par.precision),
              pipeline.cached_schedule(par.schedule, par.pp, max(shares), par.virtual_stages))
    mem, capacity = stage_memory(cfg, par, micro_batch, list(layers), *sizing, memo) \
        if par.cp == par.ep == 1 else [memory.predict(cfg, par, global_batch, pp_rank=r)
                                       for r in range(par.pp)], capacities(cluster, par)
    peaks = _step_peaks(cfg, par, cluster, micro_batch, attention, layers, mem) if exact or all(
        sum(m.values()) <= c for m, c in zip(mem, capacity)) else None   # else no fit anyway
    fullest = max(range(par.pp), key=lambda r: _most(mem[r], peaks and peaks[r]) / capacity[r])
    return Estimate(cfg, par, cluster, global_batch, micro_batch, mem[fullest], capacity[fullest],
                    tuple(layers), tuple(shares), mem,
                    model_flops=global_batch * cfg.seq_len * cfg.flops_per_token,
                    attention=attention, overlap=overlap, peak=peaks and peaks[fullest])


def _most(tally: dict, peak: dict | None) -> float:
    return max(sum(tally.values()), sum(v for k, v in (peak or {}).items() if k != "phase"))


def _step_peaks(cfg, par, cluster, b: int, attention: str, layers, mem) -> list | None:
    """The step's peak with its transients on each pipeline rank (counted: `mem`), where
    step_memory.stage_peaks predicts it, with fused attention on one GPU kind; else None."""
    if attention != "flash" or cluster.groups or par.stage_tp or cfg.n_expert or par.cp > 1:
        return None   # (step_memory walks dense layers on one device kind)
    return stage_peaks(cfg, par, b, layers, mem)


def refine(cfg, est: Estimate) -> Estimate:
    """A timed estimate on a mixed cluster, its splits searched under this model: from
    `split_layout`'s, move one layer or one share unit of micro-batches to a neighbouring chunk or
    replica; take the move that shortens the step most, while one shortens it by more than a part
    in 10^4 (not float noise) and every stage fits: 2 (chunks - 1) + 2 (dp - 1) moves a round. A
    homogeneous cluster's even split is returned as it is."""
    if not est.cluster.groups:
        return est
    unit = _share_unit(est.par)
    while True:
        moves = [([x - (c == a) + (c == b) for c, x in enumerate(est.layers)], est.shares)
                 for a, b in _neighbours(len(est.layers)) if est.layers[a] > 1]
        moves += [(est.layers, [x + unit * ((j == b) - (j == a)) for j, x in enumerate(est.shares)])
                  for a, b in _neighbours(len(est.shares)) if est.shares[a] > unit]
        tried = []
        for layers, shares in moves:
            moved = sized(cfg, est.par, est.cluster, est.global_batch, est.micro_batch, layers,
                          shares, est.attention, est.overlap)
            if moved.fits:
                tried.append(time_layout(cfg, moved))
        best = min(tried, key=lambda e: e.step_time, default=est)
        if best.step_time >= (1 - 1e-4) * est.step_time:
            return est
        est = best


def _neighbours(n: int) -> list[tuple[int, int]]:  # (from, to), every two of n in a row, both ways
    return [(a, a + 1) for a in range(n - 1)] + [(a + 1, a) for a in range(n - 1)]


def time_layout(cfg, est: Estimate) -> Estimate:
    """`est` (from `split_layout`) with its step time, breakdown and timeline filled in.

    The one place the time model is chosen: a Cluster with a CPU calibration (its `cpu` field, set
    by calibrate.this_machine and cluster_of) is timed by cpu_time.py, from the model's own layer
    measured on this machine; any other Cluster by the GPU model, gpu_step.py (gpu_time's costs)."""
    if est.cluster.cpu is not None:
        est.step_time, est.breakdown, est.simulated = cpu_time.step_time(cfg, est)
    else:
        est.step_time, est.breakdown, (est.simulated, est.time_unit) = gpu_step(cfg, est)
    return est


def estimate(cfg, par: ParallelConfig, cluster: Cluster, global_batch: int, micro_batch: int = 1,
             attention: str = "flash", overlap: str = "minipar", float8: bool = False) -> Estimate:
    """Predicted memory (fullest GPU) and step time of layout `par` on `cluster` (module docstring).
    attention: "flash" (minipar's fused SDPA: no attention matrix in memory) or "materialized"
    (Megatron-LM in 2022: the a s^2 b scores written, softmaxed and dropped out in memory; the
    activations then hold Korthikanti's 5 a s^2 b / t bytes a layer more when nothing is
    recomputed). overlap: whose overlaps and pipeline messages are timed (gpu_time.OVERLAPS):
    "minipar" (its code's), "production" (Megatron-LM's) or "deepspeed" (DeepSpeed's defaults:
    gradients reduced after backward; with a pipeline its engine's blocking messages, 1F1B and
    ZeRO 0 or 1 only); the estimate keeps which (`Estimate.overlap`). A CPU cluster is timed from
    minipar's own measured layers, whatever `overlap` says. float8: time the linear layers'
    matmuls in float8, as a published run did (GPUs of one kind; the memory stays 16-bit's)."""
    est = split_layout(cfg, par, cluster, global_batch, micro_batch, attention, overlap)
    if float8 and (cluster.groups or cluster.cpu):
        raise ValueError("float8 is timed on GPUs of one kind (not a mixed cluster or a CPU)")
    est.float8 = float8
    return refine(cfg, time_layout(cfg, est))
