"""The training loop, the same on one process and on every rank of a parallel job.

`train(cfg, par, ...)` checks the configuration, then runs `train_rank` in this process (one rank,
the single-device reference every technique is compared with) or on `par.world` ranks through
`minipar.launch` (or the ranks of a torchrun job), and merges what the ranks return.

`train_layouts` runs train_rank for many layouts, one after the other, in one job (one launch).

A step: take the global batch of this step (the same for every layout), run forward and backward on
each of this rank's micro-batches (the loss of each scaled by 1/microbatches, so the gradients are
those of the mean), step the optimizer. The loss reported is the global mean. With uneven DP shares
(ParallelConfig.dp_shares: a heterogeneous plan) each rank's loss is also weighted by its share, so
the averaged gradients are still those of the global mean.
Metrics: loss, step time, tokens/s, MFU (model FLOPs, docs/references.md, over the device's peak),
and memory by category.
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minipar import checkpoint, comm, memory
from minipar import data as dataset
from minipar.config import ParallelConfig
from minipar.hardware import peak_flops
from minipar.launch import launch, pick_backend, torchrun_rank
from minipar.mesh import Mesh
from minipar.model import GPT, GPTConfig
from minipar.parallelize import Parallel, make_optimizer, parallelize  # noqa: F401 (make_optimizer)
from minipar.pipeline.runtime import gather_stages
from minipar.precision import DTYPES
from minipar.tensor_parallel import full_state_dict
from minipar.zero import Zero3, ZeroOptimizer


@dataclass
class TrainResult:
    losses: list[float]                 # global mean loss of each step
    step_times: list[float]             # seconds per step (rank 0)
    tokens_per_s: float                 # global tokens per second, median step
    mfu: float                          # model FLOP/s over the peak of the
                                        #   devices used, median step
    peak_memory: list[dict]             # by rank: {category: bytes}, measured (on CUDA also
                                        #   "cuda_max_allocated", the allocator's peak, to compare)
    predicted_memory: list[dict]        # by rank: {category: bytes}, memory.predict's
                                        #   analytic model
    comm_bytes: list[dict]              # by rank: {collective or p2p kind: bytes sent}
    comm_calls: list[dict]              # by rank: {collective kind: calls made}
    # by rank: (what, start, end) in perf_counter seconds, what a pipeline's Action (its last step),
    # or with dp > 1 "forward", "backward", a bucket or "wait" (every step)
    spans: list[list] = field(default_factory=list, repr=False)
    state_dict: dict | None = field(default=None, repr=False)  # single-device weights, if asked

    def summary(self) -> str:
        fullest = max(sum(m[c] for c in memory.CATEGORIES) for m in self.peak_memory)
        return (f"loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f} in {len(self.losses)} steps | "
                f"{self.tokens_per_s:,.0f} tokens/s | MFU {100 * self.mfu:.1f}% | peak memory "
                f"{fullest / 2**20:.1f} MiB on the fullest rank")


@dataclass
class RankResult:
    """One rank's training run (`train_rank`); `train` merges every rank's into a TrainResult."""
    losses: list[float]                 # the global mean loss of each step (the same on every rank)
    step_times: list[float]             # seconds per step
    memory: dict                        # {category: bytes}, persistent ones at the first step, the
                                        #   activations' peak over the run (CUDA: + the allocator's)
    comm: dict                          # {collective or "p2p": bytes sent over the steps}
    calls: dict                         # {collective or "p2p": calls made over the steps}
    spans: list = field(repr=False)     # the last step's pipeline actions, or DP's spans:
                                        #   (what, start, end) in perf_counter seconds
    device: str = "cpu"
    state_dict: dict | None = field(default=None, repr=False)  # single-device weights (rank 0)


def train(cfg: GPTConfig, par: ParallelConfig | None = None, *, steps: int = 10,
          global_batch: int = 8,
          lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0, data: str = "synthetic",
          backend: str = "auto", return_state: bool = False, progress: bool = False,
          timeout: float = 600.0, save: str | None = None, save_every: int = 0,
          resume: str | None = None, on_step=None) -> TrainResult:
    """Train `cfg` laid out as `par`; see the module docstring. Bad input raises ValueError first.

    steps counts from the start of training: resuming a checkpoint of k steps runs steps - k more.
    save: a checkpoint path, written every `save_every` steps (0: at the end only) and at the end;
    resume: a checkpoint to continue from, in any layout (see checkpoint.py).
    on_step(loss, tokens_per_s), if given, is called in this process after each step (as the
    progress bar is drawn), e.g. by a dashboard's own progress bar."""
    par = par or ParallelConfig()
    par.check(cfg, global_batch)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if data not in dataset.SOURCES:
        raise ValueError(f"data must be one of {dataset.SOURCES}, got {data!r}")
    pick_backend(backend, par.world)  # a world larger than the devices fails
                                      #   here, before any process
    # a wrong file fails here too
    done = checkpoint.load(resume, cfg)["steps_done"] if resume else 0
    if done >= steps:
        raise ValueError(f"the checkpoint has {done} steps done already; ask for more than {done} "
                         "steps")
    if not isinstance(save_every, int) or save_every < 0:
        raise ValueError(f"save_every must be a non-negative integer, got {save_every!r}")
    job = dict(cfg=cfg, par=par, steps=steps, global_batch=global_batch, lr=lr,
               weight_decay=weight_decay, seed=seed, data=data, return_state=return_state,
               save=save, save_every=save_every, resume=resume)
    bar = ProgressBar(steps - done, show=progress, on_step=on_step)
    report = progress or on_step is not None
    torchrun = torchrun_rank() is not None
    try:
        if par.world == 1 and not dist.is_initialized() and not torchrun:
            device = "cuda" if backend != "gloo" and torch.cuda.is_available() else "cpu"
            ranks = [train_rank(**job, report=bar.update if report else None, device=device)]
        elif torchrun:  # this process is one rank
            ranks = launch(train_rank, par.world, report=bar.update if report else None,
                           backend=backend, timeout=timeout, **job)
        else:  # local workers report through their output, the bar is drawn here
            ranks = launch(train_rank, par.world, report=ProgressBar.print_line if report else None,
                           backend=backend, timeout=timeout, on_line=bar.on_line, **job)
    finally:
        bar.close()
    return _merge(ranks, cfg, par, global_batch)


def _merge(ranks: list[RankResult], cfg, par, global_batch: int) -> TrainResult:
    """Every rank's RankResult as one TrainResult: rank 0's losses
    and times, every rank's memory."""
    steady = ranks[0].step_times[1:] or ranks[0].step_times
    step = statistics.median(steady)
    # MFU's denominator: the peak of the devices the job ran on. Local CPU ranks share one CPU, so
    # its measured peak counts once; GPU ranks each bring their own.
    device, dtype = ranks[0].device, DTYPES[par.precision]
    peak = peak_flops(device.split(":")[0], dtype) * (par.world if device.startswith("cuda") else 1)
    return TrainResult(
        losses=ranks[0].losses, step_times=ranks[0].step_times,
        tokens_per_s=global_batch * cfg.seq_len / step,
        mfu=cfg.flops_per_token * global_batch * cfg.seq_len / step / peak,
        peak_memory=[r.memory for r in ranks], comm_bytes=[r.comm for r in ranks],
        comm_calls=[r.calls for r in ranks], spans=[r.spans for r in ranks],
        state_dict=ranks[0].state_dict, predicted_memory=_predicted(cfg, par, global_batch))


def train_rank(*, cfg: GPTConfig, par: ParallelConfig, steps: int, global_batch: int,
               lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0, data: str = "synthetic",
               return_state: bool = False, save: str | None = None, save_every: int = 0,
               resume: str | None = None, report=None, device: str | None = None,
               after_compute=None) -> RankResult:
    """One rank's training run (the arguments are train's); returns its losses, timings, memory,
    bytes sent and (rank 0, with return_state) the single-device weights.

    report(loss, tokens_per_s), if given, is called by rank 0 after each step (the progress bar).
    after_compute(seconds), if given, is called after each micro-batch's forward and backward (each
    pipeline action) with the seconds it took: a hook for demonstrations
    (demos_hetero's throttle)."""
    device = device or _device()
    mesh, stats = Mesh.build(par.dp, par.tp, par.pp), comm.CommStats()
    torch.manual_seed(seed)
    # the full model on every rank, then cut: every layout trains the same one
    model = GPT(cfg).to(device)
    resumed = checkpoint.load(resume, cfg) if resume else None
    run = parallelize(model, par, mesh, global_batch=global_batch, lr=lr, weight_decay=weight_decay,
                      stats=stats, after_compute=after_compute, resumed=resumed)
    rows = _rows(par, mesh, global_batch)
    meter, clock = memory.ActivationMeter(), _Clock(device)
    losses, step_times, mem, spans = [], [], {}, None
    first = resumed["steps_done"] if resumed else 0
    for step in range(first, steps):
        clock.start()
        # the batch: this step's global batch, the same for every layout
        x, y = dataset.global_batch(data, step, global_batch, cfg.seq_len, cfg.vocab_size, seed)
        # forward and backward of this rank's micro-batches (with pp > 1 in the schedule's order)
        loss, spans = _forward_backward(run, par, mesh, x, y, rows, device, meter, after_compute)
        # gradient sync and optimizer step, before any other collective (ZeRO-3 may be reducing)
        run.sync_and_step()
        # metrics: the global mean loss; memory at the first step (grads held, optimizer state new)
        if par.dp > 1:
            loss = _sum_over(loss * rows[2], mesh.dp_group) / par.dp
        if step == first:
            mem = _measure(run)
        run.optimizer.zero_grad()
        step_times.append(clock.stop())
        losses.append(loss)
        if report and mesh.rank == 0:
            report(loss, global_batch * cfg.seq_len / step_times[-1])
        # the checkpoint, every save_every steps (0: at the end) and at the end
        if save and ((step + 1) % (save_every or steps) == 0 or step + 1 == steps):
            _checkpoint(run, mesh, cfg, step + 1, save)
    sent, calls = dict(stats.bytes_sent), dict(stats.calls)  # the training's, not the gather below
    mem["activations"] = meter.peak
    if device.startswith("cuda"):  # the ground truth on a GPU, beside the counted categories
        mem["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
    state = _final_weights(run, mesh) if return_state else None
    run.close()
    spans = spans or (run.dp.spans if run.dp else [])
    return RankResult(losses, step_times, mem, sent, calls, spans, device,
                      state if mesh.rank == 0 else None)


def train_layouts(layouts: list, *, around=None, **common) -> list[RankResult]:
    """Train one layout after the other in this one job, each building its own grid and groups:
    every layout of `layouts` (a ParallelConfig, or a dict of train_rank's keyword arguments: par
    and any of the others) with `common`, the keyword arguments they share. Returns their
    RankResults, in order (what tests' `assert_same_training` compares with the single-process run).

    Why: on a small CPU a launch costs about a second a rank, a tiny model's step a few
    milliseconds; one launch for many layouts. around(i, run), if given, runs layout i: `run()`
    trains it and returns its RankResult; around measures what it likes around that call and returns
    the result (the calibration's probes and clocks, planner/calibrate.run_layouts)."""
    out = []
    for i, layout in enumerate(layouts):
        job = {**common, **(layout if isinstance(layout, dict) else dict(par=layout))}
        run = functools.partial(train_rank, **job)
        out.append(around(i, run) if around else run())
    return out


def _checkpoint(run: Parallel, mesh, cfg, steps_done: int, path: str) -> None:
    """Gather the checkpoint after `steps_done` steps (a collective) and write it (rank 0)."""
    state = checkpoint.gather(run.model, run.optimizer, run.mp, run.tp, mesh.pp_group, steps_done,
                              cfg)
    if state:  # rank 0
        checkpoint.save(state, path)


def _device() -> str:
    """This rank's device: its GPU under NCCL (launch set it), else the CPU."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return f"cuda:{torch.cuda.current_device()}" if nccl else "cpu"


def _rows(par, mesh, global_batch: int) -> tuple[int, int, float]:
    """(start, count, weight): this DP rank's rows [start, start + count) of the global batch
    (uneven with par.dp_shares). Its loss is the mean over its rows; DP averages gradients over the
    dp ranks, so weighting the loss by count / global_batch * dp makes that average the mean over
    the global batch (1.0 when even)."""
    shares = par.dp_rows(global_batch)
    start, count = sum(shares[:mesh.dp_rank]), shares[mesh.dp_rank]
    return start, count, count * par.dp / global_batch


def _forward_backward(run: Parallel, par, mesh, x, y, rows, device, meter, after_compute):
    """Forward and backward of this rank's micro-batches of (x, y); returns (the loss summed over
    them, the pipeline's (action, start, end) events of the step, or None). rows: `_rows`."""
    start, count, weight = rows
    if not run.pipe:
        return _accumulate(run, x, y, par, rows, device, meter, after_compute), None
    batches = [[dataset.shard_rows(t, start, count, mb, par.microbatches).to(device)
                for mb in range(par.microbatches)] for t in (x, y)]
    with meter, run.mp.autocast(), run.dp.no_sync() if run.dp else contextlib.nullcontext():
        scale = (run.mp.scaler.scale if run.mp.scaler else 1.0) * weight
        loss_sum, events = run.pipe.step(*batches, loss_scale=scale)
    return _sum_over(loss_sum, mesh.pp_group), events  # the last stage has it, the others 0


def _final_weights(run: Parallel, mesh) -> dict:
    """The single-device weights (collective: with tp > 1 every rank of the group takes part, with
    ZeRO-3 every rank gathers; every stage sends its share)."""
    if isinstance(run.optimizer, Zero3):
        run.optimizer.gather_all()  # every rank takes part; rank 0 keeps the weights
    state = full_state_dict(run.model, run.tp) if run.tp else \
        {k: v.detach().cpu().clone() for k, v in run.model.state_dict().items()}
    return {k: v for share in gather_stages(state, mesh.pp_group) for k, v in share.items()}


def _predicted(cfg, par, global_batch) -> list[dict] | None:
    """memory.predict for every rank, where the model covers the layout
    (all but ZeRO-3 with tp or pp)."""
    grid = [Mesh(par.dp, par.tp, par.pp, rank=r).coords() for r in range(par.world)]
    try:  # ZeRO's shard is the rank's place in its DP group
        return [memory.predict(cfg, par, global_batch, rank=c.dp_rank, pp_rank=c.pp_rank)
                for c in grid]
    except NotImplementedError:
        return None


def _measure(run: Parallel) -> dict[str, int]:
    """This rank's persistent memory by category (activations are filled in at the end)."""
    optimizer = run.optimizer
    if isinstance(optimizer, (ZeroOptimizer, Zero3)):
        return memory.measure(optimizer.param_tensors(), optimizer.grad_tensors(),
                              optimizer.state_tensors(),
                              comm=optimizer.comm_bytes)
    buckets = run.dp.comm_buffer_bytes if run.dp else 0
    return {**run.mp.measure(optimizer), "activations": 0, "comm": buckets}


def _accumulate(run: Parallel, x, y, par, rows, device, meter, after_compute=None) -> float:
    """Forward and backward of this rank's micro-batches one after
    the other; returns the summed loss.
    rows: `_rows`; the backward runs on loss * weight (see `_rows`)."""
    start, count, weight = rows
    mp, dp, loss_sum = run.mp, run.dp, 0.0
    for mb in range(par.microbatches):
        xb = dataset.shard_rows(x, start, count, mb, par.microbatches).to(device)
        yb = dataset.shard_rows(y, start, count, mb, par.microbatches).to(device)
        last = mb == par.microbatches - 1
        t0 = time.perf_counter()
        with meter, mp.autocast():
            loss = run.loss_fn(run.model(xb), yb) / par.microbatches
        t1 = time.perf_counter()
        with dp.no_sync() if dp and not last else contextlib.nullcontext():
            mp.scale(loss * weight if weight != 1.0 else loss).backward()
        meter.release()
        if after_compute:
            after_compute(time.perf_counter() - t0)
        if dp:  # the compute half of the spans; dp records the communication
            dp.spans += [("forward", t0, t1), ("backward", t1, time.perf_counter())]
        loss_sum += loss.item()
    return loss_sum


class _Clock:
    """A step's time: CUDA events on a GPU (the device's own clock: what the kernels took, without
    stalling the host inside the step), time.perf_counter on a CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.begin = None  # the step's start: a CUDA event, or perf_counter seconds

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
        from tqdm.auto import tqdm  # not a minipar module: only where a bar is drawn
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
