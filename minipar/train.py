"""The training loop, the same on one process and on every rank of a parallel job.

`train(cfg, par, ...)` checks the configuration, then runs `train_rank` in this process (one rank,
the single-device reference every technique is compared with) or on `par.world` ranks through
`minipar.launch` (or the ranks of a torchrun job), and merges what the ranks return.

A step: take the global batch of this step (the same for every layout), run forward and backward on
each of this rank's micro-batches (the loss of each scaled by 1/microbatches, so the gradients are
those of the mean), step the optimizer. The loss reported is the global mean. With uneven DP shares
(ParallelConfig.dp_shares: a heterogeneous plan) each rank's loss is also weighted by its share, so the
averaged gradients are still those of the global mean.
Metrics: loss, step time, tokens/s, MFU (model FLOPs, REFERENCES.md, over the device's peak), and
memory by category.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minipar import checkpoint, comm, memory
from minipar import data as dataset
from minipar.config import ParallelConfig
from minipar.hardware import peak_flops
from minipar.launch import launch, pick_backend
from minipar.mesh import Mesh
from minipar.model import GPT, GPTConfig
from minipar.parallelize import make_optimizer, parallelize  # noqa: F401  (make_optimizer: public here too)
from minipar.pipeline.runtime import gather_stages
from minipar.precision import DTYPES
from minipar.tensor_parallel import full_state_dict, sync_sequence_parallel_grads
from minipar.zero import Zero3, ZeroOptimizer


@dataclass
class TrainResult:
    losses: list[float]                 # global mean loss of each step
    step_times: list[float]             # seconds per step (rank 0)
    tokens_per_s: float                 # global tokens per second, median step
    mfu: float                          # model FLOP/s over the peak of the devices used, median step
    peak_memory: list[dict]             # by rank: {category: bytes}, measured (on CUDA also
                                        #   "cuda_max_allocated", the allocator's peak, to compare)
    predicted_memory: list[dict]        # by rank: {category: bytes}, memory.predict's analytic model
    comm_bytes: list[dict]              # by rank: {collective or p2p kind: bytes sent}
    comm_calls: list[dict]              # by rank: {collective kind: calls made}
    timelines: list[list] = field(default_factory=list, repr=False)  # by rank: (what, start, end) in
                                        #   perf_counter seconds: forward, backward, buckets, wait (dp > 1)
    state_dict: dict | None = field(default=None, repr=False)  # single-device weights, if asked

    def summary(self) -> str:
        return (f"loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f} in {len(self.losses)} steps | "
                f"{self.tokens_per_s:,.0f} tokens/s | MFU {100 * self.mfu:.1f}% | peak memory "
                f"{max(sum(m[c] for c in memory.CATEGORIES) for m in self.peak_memory) / 2**20:.1f} MiB "
                "on the fullest rank")


def train(cfg: GPTConfig, par: ParallelConfig | None = None, *, steps: int = 10, global_batch: int = 8,
          lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0, data: str = "synthetic",
          backend: str = "auto", return_state: bool = False, progress: bool = False,
          timeout: float = 600.0, save: str | None = None, save_every: int = 0,
          resume: str | None = None, on_step=None) -> TrainResult:
    """Train `cfg` laid out as `par`; see the module docstring. Bad input raises ValueError first.

    steps counts from the start of training: resuming a checkpoint of k steps runs steps - k more.
    save: a checkpoint path, written every `save_every` steps (0: at the end only) and at the end;
    resume: a checkpoint to continue from, in any layout (see checkpoint.py).
    on_step(loss, tokens_per_s), if given, is called in this process after each step (as the progress bar
    is drawn), e.g. by a dashboard's own progress bar."""
    par = par or ParallelConfig()
    par.check(cfg, global_batch)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if data not in dataset.SOURCES:
        raise ValueError(f"data must be one of {dataset.SOURCES}, got {data!r}")
    pick_backend(backend, par.world)  # a world larger than the devices fails here, before any process
    done = checkpoint.load(resume, cfg)["steps_done"] if resume else 0  # a wrong file fails here too
    if done >= steps:
        raise ValueError(f"the checkpoint has {done} steps done already; ask for more than {done} steps")
    if not isinstance(save_every, int) or save_every < 0:
        raise ValueError(f"save_every must be a non-negative integer, got {save_every!r}")
    args = (cfg, par, steps, global_batch, lr, weight_decay, seed, data, return_state)
    args += (dict(save=save, every=save_every or steps, resume=resume),)
    bar, report = ProgressBar(steps - done, show=progress, on_step=on_step), progress or on_step is not None
    try:
        if par.world == 1 and not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
            device = "cuda" if backend != "gloo" and torch.cuda.is_available() else "cpu"
            ranks = [train_rank(*args, report=bar.update if report else None, device=device)]
        elif "WORLD_SIZE" in os.environ:  # a torchrun job: this process is one rank
            ranks = launch(train_rank, par.world, *args, report=bar.update if report else None,
                           backend=backend, timeout=timeout)
        else:  # local workers report through their output, the bar is drawn here
            ranks = launch(train_rank, par.world, *args, report=ProgressBar.print_line if report else None,
                           backend=backend, timeout=timeout, on_line=bar.on_line)
    finally:
        bar.close()
    steady = ranks[0]["step_times"][1:] or ranks[0]["step_times"]
    step = statistics.median(steady)
    # MFU's denominator: the peak of the devices the job ran on. Local CPU ranks share one CPU, so
    # its measured peak counts once; GPU ranks each bring their own.
    device, dtype = ranks[0]["device"], DTYPES[par.precision]
    peak = peak_flops(device.split(":")[0], dtype) * (par.world if device.startswith("cuda") else 1)
    return TrainResult(
        losses=ranks[0]["losses"], step_times=ranks[0]["step_times"],
        tokens_per_s=global_batch * cfg.seq_len / step,
        mfu=cfg.flops_per_token * global_batch * cfg.seq_len / step / peak,
        peak_memory=[r["memory"] for r in ranks], comm_bytes=[r["comm"] for r in ranks],
        comm_calls=[r["calls"] for r in ranks], timelines=[r["timeline"] for r in ranks],
        state_dict=ranks[0]["state"], predicted_memory=_predicted(cfg, par, global_batch))


def train_rank(cfg, par, steps, global_batch, lr, weight_decay, seed, source, return_state, checkpoints=None,
               report=None, device: str | None = None, slow_ranks: dict | None = None) -> dict:
    """One rank's training run; returns its losses, timings, memory, bytes sent and (rank 0) weights.

    report(loss, tokens_per_s), if given, is called by rank 0 after each step (the progress bar).
    slow_ranks {global rank: factor >= 1}: a stated, synthetic throttle for demonstrations of
    heterogeneous devices (demos_hetero.py), not a feature of `train`: after each micro-batch's forward
    and backward (each pipeline action) such a rank sleeps (factor - 1) times what that compute took, so
    it computes like a device `factor` times slower; sleeping frees the core for the other ranks."""
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if dist.is_initialized() and \
            dist.get_backend() == "nccl" else "cpu"
    mesh = Mesh.build(par.dp, par.tp, par.pp)
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)  # the full model on every rank, then cut: every layout trains the same one
    checkpoints = checkpoints or dict(save=None, every=steps, resume=None)
    resumed = checkpoint.load(checkpoints["resume"], cfg) if checkpoints["resume"] else None
    run = parallelize(model, par, mesh, global_batch, lr, weight_decay, resumed)
    model, optimizer, mp, dp, tp, pipe = run.model, run.optimizer, run.mp, run.dp, run.tp, run.pipe
    first = resumed["steps_done"] if resumed else 0
    # this DP rank's rows: [start, start + count) of the global batch (uneven with par.dp_shares). Its
    # loss is the mean over its rows; DP averages gradients over the dp ranks, so weighting the loss by
    # count / global_batch * dp makes that average the mean over the global batch (1.0 when even)
    shares = par.dp_rows(global_batch)
    start, count = sum(shares[:mesh.dp_rank]), shares[mesh.dp_rank]
    weight = count * par.dp / global_batch
    slowdown = float((slow_ranks or {}).get(mesh.rank, 1.0))
    if not slowdown >= 1.0:
        raise ValueError(f"slow_ranks factors must be >= 1 (times slower), got {slowdown!r}")
    if pipe:
        pipe.slowdown = slowdown
    meter = memory.ActivationMeter()
    losses, step_times, mem, timeline = [], [], {}, []
    report = report if mesh.rank == 0 else None
    clock = _Clock(device)
    with comm.count() as sent:
        for step in range(first, steps):
            clock.start()
            x, y = dataset.global_batch(source, step, global_batch, cfg.seq_len, cfg.vocab_size, seed)
            if pipe:  # every micro-batch's forward and backward, in the schedule's order
                rows = [[dataset.shard_rows(t, start, count, mb, par.microbatches).to(device)
                         for mb in range(par.microbatches)] for t in (x, y)]
                with meter, mp.autocast(), dp.no_sync() if dp else contextlib.nullcontext():
                    scale = (mp.scaler.scale if mp.scaler else 1.0) * weight
                    loss_sum, timeline = pipe.step(*rows, loss_scale=scale)
                loss_sum = _sum_over(loss_sum, mesh.pp_group)  # the last stage has it, the others 0
            else:
                loss_sum = _accumulate(model, x, y, par, (start, count), device, mp, dp, meter, run.loss_fn,
                                       weight, slowdown)
            if dp:
                dp.finish()
            if tp and tp.sequence_parallel:  # after DP's reduction, which writes the gradients back
                sync_sequence_parallel_grads(model, tp)
            # the step before any other collective: ZeRO-3 may still be reducing gradients
            optimizer.step() if par.zero else mp.step(optimizer, run.reduce)
            if par.dp > 1:
                loss_sum = _sum_over(loss_sum * weight, mesh.dp_group) / par.dp  # the global mean
            if step == first:  # grads still held, optimizer state just allocated
                mem = _measure(model, optimizer, dp, mp)
            optimizer.zero_grad()
            step_times.append(clock.stop())
            losses.append(loss_sum)
            if report:
                report(loss_sum, global_batch * cfg.seq_len / step_times[-1])
            if checkpoints["save"] and ((step + 1) % checkpoints["every"] == 0 or step + 1 == steps):
                state = checkpoint.gather(model, optimizer, mp, tp, mesh.pp_group, step + 1, cfg)
                if state:  # rank 0
                    checkpoint.save(state, checkpoints["save"])
    mem["activations"] = meter.peak
    if device.startswith("cuda"):  # the ground truth on a GPU, beside the counted categories
        mem["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
    timeline = timeline or (dp.timeline if dp else [])
    if par.zero == 3 and return_state:
        optimizer.gather_all()  # every rank takes part; rank 0 keeps the weights
    run.close()
    state = None
    if return_state:  # the single-device weights; with tp > 1 every rank of the group takes part
        state = full_state_dict(model, tp) if tp else \
            {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        state = {k: v for share in gather_stages(state, mesh.pp_group) for k, v in share.items()}  # each stage's
    return dict(losses=losses, step_times=step_times, memory=mem, comm=dict(sent.bytes_sent),
                calls=dict(sent.calls), timeline=timeline, device=device, state=state if mesh.rank == 0 else None)


def _predicted(cfg, par, global_batch) -> list[dict] | None:
    """memory.predict for every rank, where the model covers the layout (all but ZeRO-3 with tp or pp)."""
    grid = [Mesh(par.dp, par.tp, par.pp, rank=r).coords() for r in range(par.world)]
    try:  # ZeRO's shard is the rank's place in its DP group
        return [memory.predict(cfg, par, global_batch, rank=c.dp_rank, pp_rank=c.pp_rank) for c in grid]
    except NotImplementedError:
        return None


def _measure(model, optimizer, dp, mp) -> dict[str, int]:
    """This rank's persistent memory by category (activations are filled in at the end)."""
    if isinstance(optimizer, (ZeroOptimizer, Zero3)):
        return memory.measure(optimizer.param_tensors(), optimizer.grad_tensors(), optimizer.state_tensors(),
                              comm=optimizer.comm_bytes)
    return {**mp.measure(optimizer), "activations": 0, "comm": dp.comm_buffer_bytes if dp else 0}


def _accumulate(model, x, y, par, rows, device, mp, dp, meter, loss_fn, weight=1.0, slowdown=1.0) -> float:
    """Forward and backward of this rank's micro-batches one after the other; returns the summed loss.
    rows: (start, count) of this DP rank's rows; the backward runs on loss * weight (see train_rank)."""
    loss_sum = 0.0
    for mb in range(par.microbatches):
        xb = dataset.shard_rows(x, *rows, mb, par.microbatches).to(device)
        yb = dataset.shard_rows(y, *rows, mb, par.microbatches).to(device)
        last = mb == par.microbatches - 1
        t0 = time.perf_counter()
        with meter, mp.autocast():
            loss = loss_fn(model(xb), yb) / par.microbatches
        t1 = time.perf_counter()
        with dp.no_sync() if dp and not last else contextlib.nullcontext():
            mp.scale(loss * weight if weight != 1.0 else loss).backward()
        meter.release()
        if slowdown > 1.0:  # the synthetic throttle (train_rank's slow_ranks)
            time.sleep((slowdown - 1.0) * (time.perf_counter() - t0))
        if dp:  # the compute half of the timeline; dp records the communication
            dp.timeline += [("forward", t0, t1), ("backward", t1, time.perf_counter())]
        loss_sum += loss.item()
    return loss_sum


class _Clock:
    """A step's time: CUDA events on a GPU (the device's own clock: what the kernels took, without
    stalling the host inside the step), time.perf_counter on a CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def start(self) -> None:
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.begin
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.begin.elapsed_time(end) / 1e3  # milliseconds -> seconds


def _sum_over(value: float, group) -> float:
    """The sum of a float over the group (metrics only: not counted as training traffic)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item()


class ProgressBar:
    """The caller's progress bar (tqdm, notebook-aware). Local ranks cannot reach it, so rank 0
    prints a tagged line per step (`print_line`) and the launcher hands those lines to `on_line`."""
    TAG = "minipar-progress:"

    def __init__(self, steps: int, show: bool, on_step=None):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=steps, desc="train", mininterval=0.5) if show else None
        self.on_step = on_step

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.on_step is not None:
            self.on_step(loss, tokens_per_s)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    @staticmethod
    def print_line(loss: float, tokens_per_s: float) -> None:
        print(f"{ProgressBar.TAG} {loss} {tokens_per_s}", flush=True)

    def on_line(self, rank: int, line: str) -> bool:
        if not line.startswith(self.TAG):
            return False
        self.update(*map(float, line.split()[1:]))
        return True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
