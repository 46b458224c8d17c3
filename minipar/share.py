"""One rank's share of a step: which rows of the global batch it takes, forward and backward of its
micro-batches (one after the other, or through the pipeline's schedule), and the held-out loss.

train.train_rank calls these once a step; they are the only place a rank's rows are cut, so a
layout (dp, microbatches, uneven dp_shares) changes which rows a rank sees, never the global batch.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from minipar import data as dataset
from minipar import moe
from minipar.parallelize import Parallel


def rows(par, mesh, global_batch: int) -> tuple[int, int, float]:
    """(start, count, weight): this DP rank's rows [start, start + count) of the global batch
    (uneven with par.dp_shares). Its loss is the mean over its rows; DP averages gradients over the
    dp ranks, so weighting the loss by count / global_batch * dp makes that average the mean over
    the global batch (1.0 when even)."""
    shares, replica = par.dp_rows(global_batch), mesh.dp_rank // par.cp   # (CP: dp x cp replicas)
    start, count = sum(shares[:replica]), shares[replica]
    return start, count, count * par.dp / global_batch


def microbatches(t: torch.Tensor, rows, par, device) -> list[torch.Tensor]:
    """This rank's rows of a global-batch tensor, cut into its par.microbatches, on `device`."""
    start, count, _ = rows
    return [dataset.shard_rows(t, start, count, mb, par.microbatches).to(device)
            for mb in range(par.microbatches)]


def forward_backward(run: Parallel, par, mesh, x, y, rows, device, meter, after_compute,
                     phase=None):
    """Forward and backward of this rank's micro-batches of (x, y); returns (the loss summed over
    them, the pipeline's (action, start, end) events of the step, or None). rows: `rows`;
    phase(name): a context that labels what runs inside (a Tracker's), pipelines aside."""
    # a MoE layer's balance loss is scaled as the language-model loss it joins (moe.py)
    loss_scale = (run.mp.scaler.scale if run.mp.scaler else 1.0) * rows[2]
    moe.set_aux_scale(run.model, loss_scale / par.microbatches)
    if not run.pipe:
        return accumulate(run, x, y, par, rows, device, meter, after_compute, phase), None
    batches = [microbatches(t, rows, par, device) for t in (x, y)]
    with meter, run.mp.autocast(), run.dp.no_sync() if run.dp else contextlib.nullcontext():
        loss_sum, events = run.pipe.step(*batches, loss_scale=loss_scale)
    return sum_over(loss_sum, run.pipe.group), events  # the last stage has it, the others 0


def accumulate(run: Parallel, x, y, par, rows, device, meter, after_compute=None,
               phase=None) -> float:
    """Forward and backward of this rank's micro-batches one after the other; returns the summed
    loss. rows: `rows`; the backward runs on loss * weight (see `rows`); phase: as
    forward_backward's."""
    weight, phase = rows[2], phase or (lambda name: contextlib.nullcontext())
    mp, dp, loss_sum = run.mp, run.dp, 0.0
    for mb, (xb, yb) in enumerate(zip(microbatches(x, rows, par, device),
                                      microbatches(y, rows, par, device))):
        last = mb == par.microbatches - 1
        t0 = time.perf_counter()
        with meter, mp.autocast(), phase("forward"):
            loss = run.loss_fn(run.model(xb), yb) / par.microbatches
        t1 = time.perf_counter()
        with dp.no_sync() if dp and not last else contextlib.nullcontext(), phase("backward"):
            mp.scale(loss * weight if weight != 1.0 else loss).backward()
        meter.release()
        if after_compute:
            after_compute(time.perf_counter() - t0)
        if dp:  # the compute half of the spans; dp records the communication
            dp.spans += [("forward", t0, t1), ("backward", t1, time.perf_counter())]
        loss_sum += loss.item()
    return loss_sum


def evaluate(run: Parallel, par, mesh, data, cfg, global_batch, seed, rows, device,
             batches: int) -> float:
    """The global mean loss on the first `batches` held-out global batches (the same ones at every
    evaluation, so the values compare), each rank its rows, in the layout (Parallel.evaluate)."""
    total = 0.0
    for k in range(batches):
        x, y = dataset.global_batch(data, k, global_batch, cfg.seq_len, cfg.vocab_size, seed,
                                    split="val")
        total += run.evaluate(microbatches(x, rows, par, device),
                              microbatches(y, rows, par, device))
    loss = total / batches
    n = par.dp * par.cp
    return sum_over(loss * rows[2], mesh.dp_group) / n if n > 1 else loss


def sum_over(value: float, group) -> float:
    """The sum of a float over the group (metrics only: not counted as training traffic)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item()
