"""Lesson 03's timing of ZeRO-3 in time: is each unit's all-gather hidden behind compute?

    all_gather_time(alpha, beta, size, n)   the alpha-beta model of a ring all-gather (seconds)
    fit_all_gather(sizes, n, seconds)       (alpha, beta) fitted to measured all-gathers
    zero3_timing(...)                       a worker (minipar.launch): all-gathers of a few sizes,
                                            then ZeRO-3 steps with every gather's launch, run and
                                            wait timed, beside the same model with nothing gathered
    gather_rows(timing, alpha, beta)        per unit and phase: gather predicted and measured,
                                            exposed (the compute waited) predicted and measured
    verdict(exposed, gather)                "hidden" or "exposed"
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from minipar import comm, data
from minipar.lessons.demos import rank_device, sync_device, zero3_trace
from minipar.model import GPT, GPTConfig, cross_entropy
from minipar.zero3 import Zero3

HIDDEN = 0.1  # a gather is "hidden" when the compute waited for it less than this share of it


def all_gather_time(alpha: float, beta: float, size, n):
    """Seconds of a ring all-gather of `size` bytes in all (each rank contributes size/N) on `n`
    ranks: (N-1) alpha + (N-1)/N * size / beta. It is the second half of the ring all-reduce
    (lesson 00's `ring_time`: a reduce-scatter then an all-gather, the same steps and bytes each),
    so half its time."""
    from minipar.lessons.viz_collectives import ring_time  # here: the workers need no matplotlib
    return ring_time(alpha, beta, size, n) / 2


def fit_all_gather(sizes, n, seconds) -> tuple[float, float]:
    """(alpha, beta) of `all_gather_time` fitted to measured all-gathers (bytes in all, N, seconds):
    lesson 00's fit of the all-reduce, given each all-gather's time twice over (see above)."""
    from minipar.lessons.viz_collectives import fit_ring_time
    return fit_ring_time(sizes, n, [2 * s for s in seconds])


def verdict(exposed: float, gather: float) -> str:
    """"hidden" if the compute waited for a gather less than HIDDEN of its time, else "exposed"."""
    return "hidden" if exposed <= HIDDEN * gather else "exposed"


def _time_all_gather(size: int, reps: int) -> list[float]:
    """Seconds of `reps` minipar ring all-gathers of `size` bytes in all (fp32), after one untimed;
    every rank waits at a barrier before each, so that they start together."""
    world = dist.get_world_size()
    shard = torch.ones(max(1, size // 4 // world), device=rank_device())
    out = shard.new_empty(shard.numel() * world)
    comm.all_gather(shard, out=out)  # warm-up
    samples = []
    for _ in range(reps):
        dist.barrier()
        sync_device()
        start = time.perf_counter()
        comm.all_gather(shard, out=out)
        sync_device()
        samples.append(time.perf_counter() - start)
    return samples


def _instrument(zero: Zero3, marks: list) -> None:
    """Record, as (what, unit, perf_counter time), when each unit's all-gather is launched
    ("launch"), runs on the communication thread ("start", "end"), and when the compute asks for
    the unit ("ask") and gets it ("got"). Instance attributes shadow Zero3's methods and its
    collectives; the hooks call them."""
    start_gather, gather = zero._start_gather, zero._gather
    unit_of = {id(u.full): i for i, u in enumerate(zero.units)}

    def launched(i: int) -> None:
        was, t = zero.units[i].gathering, time.perf_counter()  # before the job is handed over
        start_gather(i)
        if was is None and zero.units[i].gathering is not None:
            marks.append(("launch", i, t))

    def asked(i: int) -> None:
        if zero.units[i].gathered:
            return
        marks.append(("ask", i, time.perf_counter()))
        gather(i)
        marks.append(("got", i, time.perf_counter()))

    def all_gather(shard, group=None, out=None, **kw):
        marks.append(("start", unit_of.get(id(out)), time.perf_counter()))
        result = ops_all_gather(shard, group, out=out, **kw)
        marks.append(("end", unit_of.get(id(out)), time.perf_counter()))
        return result

    ops_all_gather = zero.ops.all_gather
    zero._start_gather, zero._gather = launched, asked
    zero.ops = dataclasses.replace(zero.ops, all_gather=all_gather)


def zero3_timing(cfg="tiny", per_rank_batch: int = 2, warmup: int = 2, steps: int = 5,
                 sizes=(2**12, 2**16, 2**20), reps: int = 5, trace: bool = True) -> dict:
    """A worker: first `demos.zero3_trace`'s one recorded step (if `trace`: returned as "trace");
    then `reps` ring all-gathers of each of `sizes` (bytes in all), for the alpha-beta
    fit; then `warmup` + `steps` training steps of `cfg` under Zero3, each beside the same model
    with nothing sharded (the baseline: the compute alone), interleaved; every timed piece starts
    at a barrier. The warm-up steps are dropped (the first makes AdamW's moments and pays the
    process's one-time costs). Returns {"world", "sizes", "gather_samples": seconds per size,
    "units": names in forward order, "unit_bytes": each unit's gathered bytes, "steps": per recorded
    step {"local": the baseline's forward + backward, "forward", "backward", "step": Zero3's
    (seconds), "backward_start": time, "marks": `_instrument`'s}}."""
    cfg = GPTConfig.preset(cfg) if isinstance(cfg, str) else cfg
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    traced = zero3_trace(cfg, per_rank_batch) if trace else None
    samples = [_time_all_gather(size, reps) for size in sizes]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    local = copy.deepcopy(model)  # the baseline: the same compute, nothing gathered
    names = {id(m): name for name, m in model.named_modules()}
    zero = Zero3(model, None)
    marks, records = [], []
    _instrument(zero, marks)
    for step in range(warmup + steps):
        x, y = data.global_batch("synthetic", step, per_rank_batch * world, cfg.seq_len,
                                 cfg.vocab_size)
        x, y = data.shard(x, rank, world).to(device), data.shard(y, rank, world).to(device)
        dist.barrier()
        sync_device()
        t0 = time.perf_counter()
        cross_entropy(local(x), y).backward()
        sync_device()
        baseline = time.perf_counter() - t0
        local.zero_grad(set_to_none=True)
        marks.clear()
        dist.barrier()  # every rank starts the step together
        sync_device()
        t0 = time.perf_counter()
        loss = cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        zero.step()
        zero.zero_grad()
        sync_device()
        records.append(dict(local=baseline, forward=t1 - t0, backward=t2 - t1,
                            step=time.perf_counter() - t2, backward_start=t1, marks=list(marks)))
    zero.close()
    return {"world": world, "sizes": list(sizes), "gather_samples": samples,
            "units": [names[id(u.module)] for u in zero.units],
            "unit_bytes": [u.full.numel() * u.full.element_size() for u in zero.units],
            "steps": records[warmup:], "trace": traced}


def _spans(record: dict) -> dict:
    """{(phase, unit): {mark: time}} of one recorded step: each unit's marks in time order, one
    gather ending at each "got" (the compute has the unit), its phase "forward" or "backward"
    that of its first mark (the launch, or the request that launched it)."""
    spans, open_ = {}, {}
    for what, i, t in sorted(record["marks"], key=lambda mark: mark[2]):
        marks = open_.setdefault(i, {"t": t})
        marks[what] = t
        if what == "got":
            phase = "forward" if open_.pop(i)["t"] < record["backward_start"] else "backward"
            spans[phase, i] = marks
    return spans


def _median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def gather_rows(timing: dict, alpha: float, beta: float) -> list[dict]:
    """One row per all-gather of a step, in the order the compute gets them (forward, backward),
    over the recorded steps (medians, and (min, max) spreads, in seconds):
      gather      the all-gather on the communication thread, measured; `predicted` by
                  all_gather_time(alpha, beta, the unit's bytes, N)
      window      the compute it can hide behind: from its launch to when the compute asks for
                  the unit (the previous unit's forward, or the next one's backward; 0 for the first
                  unit of each phase, which nothing prefetches)
      exposed     how long the compute waited for it, measured; `exposed_predicted` =
                  max(0, predicted - (window - queued)), queued being how long the launch waited
                  for the communication thread (behind another collective), measured
    and each's verdict."""
    per = {}
    for record in timing["steps"]:
        for key, s in _spans(record).items():
            per.setdefault(key, []).append(dict(
                gather=s["end"] - s["start"], window=max(0.0, s["ask"] - s["launch"]),
                queued=s["start"] - s["launch"], exposed=s["got"] - s["ask"]))
    rows = []
    for (phase, i), runs in per.items():
        row = dict(phase=phase, unit=timing["units"][i], bytes=timing["unit_bytes"][i])
        for k in ("gather", "window", "queued", "exposed"):
            row[k], *row[k + "_spread"] = _median_spread([r[k] for r in runs])
        row["predicted"] = float(all_gather_time(alpha, beta, row["bytes"], timing["world"]))
        row["exposed_predicted"] = max(0.0, row["predicted"] - (row["window"] - row["queued"]))
        row["verdict_predicted"] = verdict(row["exposed_predicted"], row["predicted"])
        row["verdict"] = verdict(row["exposed"], row["gather"])
        rows.append(row)
    return rows


def step_summary(timing: dict, rows: list[dict]) -> dict:
    """Forward + backward over the recorded steps (seconds, median and (min, max)): "baseline",
    the same model with nothing gathered; "measured", Zero3's; "predicted", the baseline plus every
    gather's predicted exposure (`gather_rows`). "flagged": the baseline was not the faster at the
    median, so the machine was too busy for the comparison to mean anything."""
    base = [r["local"] for r in timing["steps"]]
    zero = [r["forward"] + r["backward"] for r in timing["steps"]]
    out = {"baseline": _median_spread(base), "measured": _median_spread(zero)}
    out["predicted"] = out["baseline"][0] + sum(r["exposed_predicted"] for r in rows)
    out["flagged"] = out["baseline"][0] >= out["measured"][0]
    return out
