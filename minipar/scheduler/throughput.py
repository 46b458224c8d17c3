"""The throughput matrix: each job type's steps/s on each accelerator kind and count, with the
layout that achieves it, from minipar's planner; and the cost of a restart.

Gavel, Sia and their kind need a job's throughput on every accelerator kind and count; they profile
it. minipar's planner predicts it: `rate(job type, kind, count)` is 1 / the step time of
`minipar.plan`'s fastest layout of that model and global batch on `count` chips of catalogue kind
`kind` (`slice_of`), 0 where no layout fits, cached. `layout` returns that Estimate (its
ParallelConfig is how the job runs there: a new allocation means a new layout).

`to_gavel` writes the matrix in Gavel's throughputs JSON form ({worker type: {"(job type, scale
factor)": {"null": steps/s}}}, "null" being the job alone on those workers), so Gavel's simulator
and others that read it can consume minipar's predictions.

A preemption (a job stopped, then resumed, perhaps elsewhere in another layout) costs, stated and
assumed, for P parameters (checkpoint.py's file: fp32 weights and Adam's two moments):
    stop     12 P / STORAGE_RATE: the checkpoint gathered to one rank and written
    restart  STARTUP_S + 12 P / STORAGE_RATE: processes started, the file read by every rank (the
             storage serving each node at that rate); the first start pays STARTUP_S alone
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping

from minipar.model import GPTConfig
from minipar.planner import Cluster, NoFeasiblePlan, plan
from minipar.planner.devices import CATALOGUE

STARTUP_S = 30.0        # ASSUMED: processes, torch import, NCCL communicators, the data loader
STORAGE_RATE = 2e9      # ASSUMED: bytes/s a checkpoint is written or read at (a node's share of a
                        #   parallel file system, or a local NVMe)
CHECKPOINT_BYTES = 12   # a parameter's bytes in a checkpoint: fp32 weight + two fp32 moments


def capacity(cluster) -> dict:
    """{kind: chips} of a cluster: a mapping as given, a Cluster's parts (one kind each) by name."""
    if isinstance(cluster, Mapping):
        caps = dict(cluster)
    else:
        caps = {}
        for part in cluster.groups or (cluster,):
            caps[part.name] = caps.get(part.name, 0) + part.world
    if not caps or any(not (isinstance(n, int) and n >= 1) for n in caps.values()):
        raise ValueError(f"a cluster is {{kind: chips}} with chips a positive integer, got {caps}")
    return caps


def slice_of(kind: str, count: int) -> Cluster:
    """`count` chips of catalogue kind `kind` as a Cluster: whole islands when count fills them,
    else part of one. On a full-mesh fabric (MI300X, Gaudi 3) the part keeps the links among its
    chips only, (count - 1) / (domain - 1) of the island's (Cluster.link)."""
    if kind not in CATALOGUE:
        raise ValueError(f"unknown accelerator kind {kind!r}; choose from {sorted(CATALOGUE)}")
    domain = CATALOGUE[kind].domain
    if count >= domain:
        if count % domain:
            raise ValueError(f"{count} chips of {kind} are not whole islands of {domain}")
        return Cluster.preset(kind, nodes=count // domain)
    island = Cluster.preset(kind)
    share = (count - 1) / (domain - 1) if island.intra_mesh and count > 1 else 1.0
    return dataclasses.replace(island, gpus_per_node=count,
                               intra_bandwidth=island.intra_bandwidth * share)


@functools.lru_cache(maxsize=4096)
def layout(job_type: tuple, kind: str, count: int):
    """The planner's fastest layout (an Estimate) of job_type = (GPT preset, global batch) on
    `count` chips of `kind`, or None when none fits (or the batch does not split over them)."""
    model, global_batch = job_type
    try:
        return plan(GPTConfig.preset(model), slice_of(kind, count), global_batch)[0]
    except NoFeasiblePlan:
        return None
    except ValueError as e:   # e.g. islands that do not tile the count
        if "whole islands" in str(e):
            return None
        raise


def rate(job_type: tuple, kind: str, count: int) -> float:
    """Steps/s of job_type on `count` chips of `kind` in its best layout (0: nothing fits)."""
    est = layout(job_type, kind, count)
    return 0.0 if est is None else 1.0 / est.step_time


def checkpoint_seconds(job_type: tuple) -> float:
    """Seconds to write, or to read, job_type's checkpoint (module docstring)."""
    return CHECKPOINT_BYTES * GPTConfig.preset(job_type[0]).num_params / STORAGE_RATE


def throughput_matrix(jobs, cluster, rate=rate) -> dict:
    """{job name: {(kind, count): steps/s}} for every kind of `cluster` and count the job accepts
    (up to the kind's chips); rate(job type, kind, count) gives each (the planner's by default)."""
    caps = capacity(cluster)
    return {job.name: {(kind, n): rate(job.kind, kind, n)
                       for kind, chips in caps.items() for n in job.counts if n <= chips}
            for job in jobs}


def to_gavel(jobs, matrix: dict) -> str:
    """The matrix as Gavel's throughputs JSON (module docstring), one entry per job type, scale."""
    out: dict = {}
    for job in jobs:
        for (kind, n), steps_per_s in matrix[job.name].items():
            key = str((f"{job.model} (batch size {job.global_batch})", n))
            out.setdefault(kind, {})[key] = {"null": steps_per_s}
    return json.dumps(out, indent=1, sort_keys=True)
