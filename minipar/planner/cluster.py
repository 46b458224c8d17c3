"""The cluster as a value: GPUs, their speed and memory, and the links between them; presets of
vendor figures; mixed clusters of several kinds. No I/O here:
`planner.calibrate` makes one of this machine."""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

from minipar.mesh import grid_ranks
from minipar.planner.devices import CATALOGUE, GiB, preset



def memory_unit(*nbytes: float) -> tuple[float, str]:
    """(bytes a unit, its name) that shows these sizes readably: GiB from 1 GiB, else MiB (this
    machine's layouts need a few MiB: 0.0 GiB in every row says nothing)."""
    return (GiB, "GiB") if max(nbytes, default=0) >= GiB else (2 ** 20, "MiB")


def flops_unit(*rates: float) -> tuple[float, str]:
    """(FLOP/s a unit, its name) for these rates: TFLOP/s from 1e12, else GFLOP/s."""
    return (1e12, "TFLOP/s") if max(rates, default=0) >= 1e12 else (1e9, "GFLOP/s")


class Link(NamedTuple):
    bandwidth: float  # bytes/s per GPU, one direction
    latency: float    # s per message (a ring step)


@dataclass(frozen=True)
class Cluster:
    """GPUs, their speed and memory, and the links between them.
    Homogeneous unless `groups` is set."""
    gpus_per_node: int
    nodes: int
    memory_per_gpu: float     # bytes the training job may use on one GPU
    peak_flops: float         # dense bf16 FLOP/s of one GPU (the MFU denominator)
    efficiency: float         # the matmul ceiling: fraction of peak a full wave of tiles
                              #   reaches (one number per GPU kind; gpu_time.matmul)
    intra_bandwidth: float    # bytes/s per GPU, one direction, within a node (NVLink)
    intra_latency: float      # s per message within a node
    inter_bandwidth: float    # bytes/s per GPU across nodes (its NIC)
    inter_latency: float      # s per message across nodes
    memory_bandwidth: float = 2.0e12  # HBM bytes/s: the memory-bound kernels and the optimizer step
    sms: int = 108            # streaming multiprocessors: matmul tiles computed at once
                              #   (gpu_time.matmul's waves)
    usable: float = 0.8       # of memory_per_gpu, what the counted tensors may fill; the rest is
                              #   the allocator's fragmentation and cache, NCCL's buffers, cuBLAS's
                              #   workspaces and the CUDA context. The ZeRO paper's Table II
                              #   measured about 80% of the theoretical model size as trainable
    intra_mesh: bool = False  # the island is a full mesh of direct links (MI300X, Gaudi 3): a
                              #   group of k of its chips gets (k - 1) / (gpus_per_node - 1) of
                              #   intra_bandwidth, the links among them (`link`)
    pod: int = 0              # islands (nodes) a pod holds: full bisection bandwidth among
                              #   them, `oversubscription` above (0: the cluster is one pod)
    oversubscription: float = 1.0  # across pods a chip's NIC gets 1/this of its bandwidth: the
                              #   switches above a pod have that many times fewer links than
                              #   below (Llama 3's clusters: pods of 3,072 GPUs, 1:7 above)
    spine_latency: float = 0.0  # s a message crossing pods adds to inter_latency (the switch
                              #   tiers above a pod; 0 unless given)
    name: str = "custom"
    groups: tuple = ()        # heterogeneous: homogeneous Clusters in rank order (see `mixed`)
    cpu: object = None        # None: GPUs, timed by gpu_time.py. A calibrate.CPU (set by
                              # calibrate.this_machine, cluster_of): local CPU ranks, timed by
                              # cpu_time.py instead (chosen in one place, predict.time_layout)

    # Vendor figures: the catalogue (devices.py), one island each. intra_bandwidth is what NCCL
    # moves over NVLink: 80% of the line rate (A100 300, H100 and H200 450 GB/s a direction), as
    # NCCL's protocol costs about 20% (its maintainer, NVIDIA/nccl-tests issue 212: "450GB/s is
    # the line rate ... NCCL can get an effective NVLink bandwidth of 370GB/s"). inter_bandwidth
    # is one NIC per GPU at line rate: HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s. Latencies
    # are per ring step (an 8-GPU all-reduce pays 14), assumed: 1 us over NVLink, 5 us over IB.
    #
    # The ceiling (`efficiency`): the fraction of peak a full wave of matmul tiles reaches
    # (gpu_time.matmul adds the tile and wave quantization and the HBM bound of each matmul's
    # shape), one number per GPU kind, never fitted to a row of a table. A100: Korthikanti et al.
    # 2022 Table 4 times one 22B layer with sequence parallelism (t = 8, b = 4, no
    # recomputation) at 7.2 ms forward + 11.8 ms backward; under this model its matmuls then ran
    # at a ceiling of 0.77 (`gpu_time.fit_efficiency` redoes it; the table's other four rows then
    # come out within 10%). H200: an 8192^3 bf16 matmul through PyTorch ran at 790 of 989 TFLOP/s
    # on one H200 (measured once for minipar, on a GPU lent for an earlier issue; not re-measured
    # since), a ceiling of 0.82 once its last wave's idle SMs are counted (`gpu_time.ceiling_of`).
    # H100 SXM: the same GH100 chip, SMs and peak, so the H200's ceiling, assumed (its HBM
    # differs, and the bytes are modelled apart). The other kinds: devices.ASSUMED_CEILING.
    PRESETS = CATALOGUE

    def __post_init__(self):
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Cluster.{name} must be a positive integer, got {value!r}")
        for name in ("memory_per_gpu", "peak_flops", "intra_bandwidth", "inter_bandwidth",
                     "memory_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("efficiency", "usable"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Cluster.{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not isinstance(self.pod, int) or isinstance(self.pod, bool) or self.pod < 0:
            raise ValueError(f"Cluster.pod must be a whole number of nodes (0: one pod), got "
                             f"{self.pod!r}")
        if not self.oversubscription >= 1 or not self.spine_latency >= 0:
            raise ValueError(f"Cluster.oversubscription must be >= 1 and spine_latency >= 0, got "
                             f"{self.oversubscription!r}, {self.spine_latency!r}")

    @classmethod
    def preset(cls, name: str, nodes: int = 1, **network) -> "Cluster":
        """`nodes` islands of a catalogue kind (devices.CATALOGUE: an 8-GPU board, a TPU slice);
        network: any of pod, oversubscription, spine_latency (the scale-out network's levels)."""
        extra = set(network) - {"pod", "oversubscription", "spine_latency"}
        if extra:
            raise ValueError(f"Cluster.preset takes pod, oversubscription and spine_latency, not "
                             f"{sorted(extra)}")
        return cls(nodes=nodes, **preset(name), **network)

    @classmethod
    def mixed(cls, parts) -> "Cluster":
        """One cluster of several kinds, ranks numbered part after part (whole islands each: a
        part's node is its scale-up domain, e.g. 8 GPUs on NVLink, 16 Trainium2 on NeuronLink).
        Islands talk over the scale-out network at the slowest part's NIC and latency: kinds of
        different vendors share no collective library inside an island (NCCL, RCCL, HCCL, XLA's
        ICI collectives, Neuron's), so what crosses islands goes through the NICs. A TP group
        never spans islands: its all-reduces sit between dependent matmuls, where the scale-out
        network's bandwidth would dominate, and no library runs one across vendors. So the mixed
        cluster's gpus_per_node is the largest group that tiles every part's islands, the greatest
        common divisor of their sizes: the TP degrees `plan` tries, and tp-innermost TP groups
        (mesh.py) never straddle two islands. Its `nodes` counts those tiles (world / tile), not
        islands: `island(rank)` names a rank's. Capacities and speeds stay per part (`device`)."""
        parts = tuple(p for part in parts for p in (part.groups or (part,)))
        slowest = min(parts, key=lambda p: p.peak_flops * p.efficiency)
        tile = math.gcd(*(p.gpus_per_node for p in parts))
        return dataclasses.replace(
            slowest, gpus_per_node=tile, nodes=sum(p.world for p in parts) // tile,
            name="+".join(f"{p.nodes}x{p.name}" for p in parts),
            memory_per_gpu=min(p.memory_per_gpu for p in parts),
            inter_bandwidth=min(p.inter_bandwidth for p in parts),
            inter_latency=max(p.inter_latency for p in parts), pod=0,
            oversubscription=max(p.oversubscription for p in parts),
            spine_latency=max(p.spine_latency for p in parts),
            groups=parts if len(parts) > 1 else ())

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def peak_total(self) -> float:
        return sum(g.peak_flops * g.world
                   for g in self.groups) if self.groups else self.peak_flops * self.world

    def device(self, rank: int) -> "Cluster":
        """The homogeneous part that GPU `rank` belongs to (the cluster itself when homogeneous)."""
        if not self.groups or rank >= self.world:  # (past the last part: the cluster's own figures)
            return self
        return self.groups[bisect.bisect_right(self._starts, rank) - 1]

    @functools.cached_property
    def _starts(self) -> tuple[int, ...]:
        """The first rank of each part: parts are contiguous ranges of ranks, in order."""
        return tuple(itertools.accumulate([0, *(g.world for g in self.groups)]))[:-1]

    def parts_of(self, ranks) -> list["Cluster"]:
        """The homogeneous parts that the GPUs `ranks` run on: a look-up a part, not one a rank
        (a stage of a 1000-GPU plan holds hundreds)."""
        if not self.groups:
            return [self]
        ranks = sorted(ranks)
        return [g for g, start in zip(self.groups, self._starts)
                if (i := bisect.bisect_left(ranks, start)) < len(ranks) and
                ranks[i] < start + g.world] + [self] * (ranks[-1] >= self.world)

    @functools.lru_cache(maxsize=4096)
    def tp_parts(self, dp: int, tp: int, pp: int, stage_tp: tuple | None = None) -> tuple:
        """The parts that each TP group of a dp x tp x pp grid (mesh.py; stage_tp: each stage's
        tp) runs on, indexed [dp_rank][pp_rank]; cached: the planner asks with every split."""
        return tuple(tuple(tuple(self.parts_of(grid_ranks(dp, tp, pp, r, j, stage_tp)))
                           for r in range(pp)) for j in range(dp))

    def island(self, rank: int) -> tuple[int, int]:
        """(part, node within it) of GPU `rank`: its scale-up domain (one node when homogeneous)."""
        if not self.groups or rank >= self.world:  # (past the last part: the cluster's nodes)
            return 0, (rank - self.world * bool(self.groups)) // self.gpus_per_node
        i = bisect.bisect_right(self._starts, rank) - 1
        return i, (rank - self._starts[i]) // self.groups[i].gpus_per_node

    def pod_of(self, rank: int) -> tuple[int, int]:
        """(part, pod within it) of GPU `rank`: its island's pod (`pod` islands each; a mixed
        cluster's parts are pods of their own, joined above their switches)."""
        part, node = self.island(rank)
        size = (self.groups[part] if self.groups and rank < self.world else self).pod
        return part, node // size if size else 0

    def link(self, ranks) -> Link:
        """The link a collective among `ranks` runs on, the slowest level it crosses (a ring's
        every step waits for its slowest hop): the scale-up fabric (NVLink...) within one island,
        on a full mesh the links among the group's chips only (`intra_mesh`);
        the NICs within one pod; across pods the NICs' share above it, 1 / oversubscription of
        their bandwidth, and spine_latency more a message. (Islands and pods are contiguous
        ranges of ranks: the lowest and the highest rank decide.)"""
        low, high = min(ranks), max(ranks)
        if self.island(low) == self.island(high):
            dev = self.device(low)
            share = (len(ranks) - 1) / (dev.gpus_per_node - 1) if dev.intra_mesh and \
                dev.gpus_per_node > 1 else 1.0
            return Link(dev.intra_bandwidth * share, dev.intra_latency)
        if self.pod_of(low) == self.pod_of(high):
            return Link(self.inter_bandwidth, self.inter_latency)
        return Link(self.inter_bandwidth / self.oversubscription,
                    self.inter_latency + self.spine_latency)

    def rate(self, ranks, precision: str) -> float:
        """Matmul FLOP/s of the slowest GPU among `ranks` (fp32 as TF32: half the 16-bit peak)."""
        return rate_of(self.parts_of(ranks), precision)


def rate_of(parts, precision: str) -> float:
    """Matmul FLOP/s of the slowest of these parts' GPUs (Cluster.rate, from parts known)."""
    return min(g.peak_flops * g.efficiency for g in parts) * (0.5 if precision == "fp32" else 1.0)
