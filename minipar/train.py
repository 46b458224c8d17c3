"""The training loop, the same on one process and on every rank of a parallel job.

`train(cfg, par, ...)` checks the configuration, then runs `train_rank` in this process (one rank,
the single-device reference every technique is compared with) or on `par.world` ranks through
`minipar.launch` (or the ranks of a torchrun job), and merges what the ranks return;
`train_layouts` runs train_rank for many layouts, one after the other, in one job (one launch).

A step: set the step's learning rate (`lr_at`: warmup, cosine decay), take the global batch of
this step (the same for every layout), run forward and backward on each of this rank's micro-batches
(the loss of each scaled by 1/microbatches, so the gradients are those of the mean), average the
gradients, clip them by their global norm if asked, step the optimizer. The loss reported is the
global mean. With uneven DP shares (ParallelConfig.dp_shares: a heterogeneous plan) each rank's loss
is also weighted by its share, so the averaged gradients are still those of the global mean.
Every `eval_every` steps: the loss on held-out batches (data.py's "val" split). A non-finite loss
stops the run (NonFiniteLoss), with no checkpoint of the broken weights.
Metrics (loss, validation loss, step time, tokens/s, MFU, gradient norm, memory): per step to JSON
lines, TensorBoard if asked (metrics). MFU: model FLOPs over hardware.peak's peak.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minipar import checkpoint, comm, hardware, memory, preflight, server, share
from minipar import data as dataset
from minipar.activations import Unmetered
from minipar.config import ParallelConfig
from minipar.launch import heartbeat, launch, pick_backend
from minipar.metrics import MetricsLog, ProgressBar, StepClock, check_tensorboard, max_memory_mib
from minipar.mesh import Mesh
from minipar.model import GPT, GPTConfig
from minipar.parallelize import make_optimizer, parallelize  # noqa: F401 (make_optimizer)
from minipar.precision import DTYPES
from minipar.tracker import Tracker


@dataclass
class TrainResult:
    losses: list[float]                 # global mean loss of each step
    step_times: list[float]             # seconds per step (rank 0)
    tokens_per_s: float                 # global tokens per second, median step
    mfu: float                          # model FLOP/s over the peak of the
                                        #   devices used, median step
    peak_memory: list[dict]             # by rank: {category: bytes}, the first step's tally (on
                                        #   CUDA also "cuda_max_allocated"); the peak: step_peak
    predicted_memory: list[dict]        # by rank: {category: bytes}, memory.predict's
                                        #   analytic model
    comm_bytes: list[dict]              # by rank: {collective or p2p kind: bytes sent}
    comm_calls: list[dict]              # by rank: {collective kind: calls made}
    # by rank: (what, start, end) in perf_counter seconds, what a pipeline's Action (its last step),
    # or with dp > 1 "forward", "backward", a bucket or "wait" (every step)
    spans: list[list] = field(default_factory=list, repr=False)
    state_dict: dict | None = field(default=None, repr=False)  # single-device weights, if asked
    val_losses: list[tuple] = field(default_factory=list)  # (step, global mean held-out loss)
    grad_norms: list[float] = field(default_factory=list)  # each step's, before clipping (if clip)
    peak: hardware.Peak | None = None   # MFU's denominator (per device) and where it comes from
    data: dataset.Dataset | None = field(default=None, repr=False)  # what it trained on: decode
    # by rank, over one whole step (the second: the first runs forward before AdamW's moments
    # exist), from tensor lifetimes (minipar.tracker): {"held": {category: bytes} when states,
    # buffers and activations were most; "total": with autograd's "temporaries"; each a "phase"}
    step_peak: list[dict] = field(default_factory=list)
    memory_timelines: list[list] = field(default_factory=list, repr=False)  # Tracker.timeline
    preempted: int = 0                  # steps done when the stop file stopped it (0: it did not)

    def summary(self) -> str:
        held = [p["held"] for p in self.step_peak if p]   # none: stopped before the watched step
        what = "peak memory over a step" if held else "memory after a step"
        fullest = max(sum(m[c] for c in memory.CATEGORIES) for m in held or self.peak_memory)
        val = f" (validation {self.val_losses[-1][1]:.3f})" if self.val_losses else ""
        against = f"\nMFU is against {self.peak.source}" if self.peak else ""
        stop = f" (preempted: stopped after step {self.preempted})" if self.preempted else ""
        return (f"loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}{val} in {len(self.losses)} "
                f"steps{stop} | {self.tokens_per_s:,.0f} tokens/s | MFU {100 * self.mfu:.1f}% | "
                f"{what} {fullest / 2**20:.1f} MiB on the fullest rank{against}")


@dataclass
class RankResult:
    """One rank's training run (`train_rank`); `train` merges every rank's into a TrainResult."""
    losses: list[float]                 # the global mean loss of each step (the same on every rank)
    step_times: list[float]             # seconds per step
    memory: dict                        # {category: bytes}, persistent ones at the first step, the
                                        #   activations' peak over the run (CUDA: + the allocator's)
    comm: dict                          # {collective or "p2p": bytes sent over the steps}
    calls: dict                         # {collective or "p2p": calls made over the steps}
    spans: list = field(repr=False)     # last step's pipeline actions, or DP's (what, start, end)
    device: str = "cpu"
    state_dict: dict | None = field(default=None, repr=False)  # single-device weights (rank 0)
    val_losses: list[tuple] = field(default_factory=list)  # (step, global mean held-out loss)
    grad_norms: list[float] = field(default_factory=list)  # before clipping, when clip > 0
    stopped: int = 0                    # the step whose loss was not finite (0: none)
    preempted: int = 0                  # steps done when the stop file stopped it (0: it did not)
    step_memory: dict = field(default_factory=dict)  # the tracked step's peaks (`_peaks`)
    timeline: list = field(default_factory=list, repr=False)  # its Tracker.timeline
    tracked_activations: int = 0        # the tracked step's most activations
    par: ParallelConfig | None = field(default=None, repr=False)


def train(cfg: GPTConfig, par: ParallelConfig | None = None, *, steps: int = 10,
          global_batch: int = 8, lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0,
          data="synthetic", tokenizer: str = "char", backend: str = "auto",
          return_state: bool = False, progress: bool = False, timeout: float = 600.0,
          save: str | None = None, save_every: int = 0, resume: str | None = None,
          clip: float = 0.0, warmup: int = 0, decay: str = "none", eval_every: int = 0,
          eval_batches: int = 2, metrics: str | None = None, tensorboard: str | None = None,
          on_step=None, slowdown: float = 1.0, stop_file: str | None = None) -> TrainResult:
    """Train `cfg` laid out as `par`; see the module docstring. Bad input raises ValueError first,
    before any process starts (minipar/preflight.py says what is checked).

    data: "synthetic", "shakespeare", a path to a text file or a folder of them, or a
    data.Dataset; tokenizer: "char" or "bpe" (trained on the data, to cfg.vocab_size tokens).
    steps counts from the start of training: resuming a checkpoint of k steps runs steps - k more.
    save: a checkpoint path, written every `save_every` steps (0: at the end only) and at the end;
    resume: a checkpoint to continue from, in any layout (see checkpoint.py).
    clip: the largest global gradient norm (0: no clipping); warmup: steps of linear warmup of
    the learning rate; decay "cosine": down to lr / 10 at the last step (`lr_at`).
    eval_every: the validation loss on `eval_batches` held-out batches every that many steps and
    at the end (0: never). metrics: a JSON-lines file, tensorboard: a folder (metrics.py).
    timeout: seconds without any progress after which the job is stopped as hung (not a limit on
    its length). on_step(loss, tokens_per_s), if given, is called in this process after each step
    (as the progress bar is drawn), e.g. by a dashboard's own progress bar.
    slowdown: every rank computes that many (>= 1) times slower, a slower kind of device emulated
    (hardware.throttle). stop_file: graceful preemption. After each step but the last, rank 0
    looks for this file (on its machine); if it is there, every rank writes the checkpoint to
    `save` (needed) and stops after that same step, `.preempted` saying how many steps are done;
    resuming it, in any layout, continues the same training. The file is left for its owner to
    remove (a run resumed while it is there stops after one step). Cost, only with a stop_file:
    one broadcast of one number over the world a step (0.3 ms on 2 gloo ranks of a 2-core machine,
    1 ms on 4; a tiny model's step there takes ~30 ms)."""
    # long: every check before any process starts, one line each, then the launch
    par = par or ParallelConfig()
    par.check(cfg, global_batch)
    preflight.check_settings(steps=steps, lr=lr, weight_decay=weight_decay, clip=clip,
                             warmup=warmup, decay=decay, eval_every=eval_every,
                             eval_batches=eval_batches, save_every=save_every, timeout=timeout,
                             slowdown=slowdown, stop_file=stop_file, save=save)
    # a world larger than the devices fails here (under torchrun: this node's share of it)
    joined = server.torchrun_rank() is not None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", par.world)) if joined else par.world
    backend = pick_backend(backend, local)
    device = "cuda" if backend == "nccl" or (backend == "auto" and par.world == 1
                                             and torch.cuda.is_available()) else "cpu"
    for path, what in ((save, "save"), (metrics, "metrics")):
        preflight.check_writable(path, what)
    preflight.check_writable(tensorboard, "tensorboard", folder=True)
    check_tensorboard(tensorboard)
    saved = checkpoint.load(resume, cfg) if resume else None  # a wrong file fails here too
    done = saved["steps_done"] if saved else 0
    if done >= steps:
        raise ValueError(f"the checkpoint has {done} steps done already; ask for more than {done} "
                         "steps")
    data = dataset.for_run(data, tokenizer, cfg.vocab_size, saved and saved.get("data"))
    dataset.check(data, cfg.vocab_size, cfg.seq_len)
    settings = dict(global_batch=global_batch, seed=seed, data=data.source,
                    tokenizer=data.tokenizer, vocab=data.fingerprint, lr=lr,
                    weight_decay=weight_decay, warmup=warmup, decay=decay, clip=clip)
    preflight.check_resume(saved and saved.get("run"), settings)
    preflight.check_memory(cfg, par, global_batch, device)
    peak = hardware.peak(device, DTYPES[par.precision])
    job = dict(cfg=cfg, par=par, steps=steps, global_batch=global_batch, lr=lr,
               weight_decay=weight_decay, seed=seed, data=data, return_state=return_state,
               save=save, save_every=save_every, resume=resume, clip=clip, warmup=warmup,
               decay=decay, eval_every=eval_every, eval_batches=eval_batches, metrics=metrics,
               tensorboard=tensorboard, settings=settings, slowdown=slowdown, stop_file=stop_file,
               peak_flops=peak.flops * (par.world if device == "cuda" else 1))
    bar = ProgressBar(steps - done, show=progress, on_step=on_step)
    try:
        ranks = _run(job, backend, device, timeout, bar, report=progress or on_step is not None)
    finally:
        bar.close()
    result = _merge(ranks, cfg, global_batch, peak, job["peak_flops"])
    result.data = data
    if ranks[0].stopped:
        raise NonFiniteLoss(ranks[0].stopped, result)
    return result


def _run(job: dict, backend: str, device: str, timeout: float, bar, report: bool) -> list:
    """train_rank on every rank: here (one process), as this rank of a torchrun job, or on local
    workers, which report through their output (the bar is drawn here)."""
    par = job["par"]
    if par.world == 1 and not dist.is_initialized() and server.torchrun_rank() is None:
        return [train_rank(**job, report=bar.update if report else None, device=device)]
    if server.torchrun_rank() is not None:
        return launch(train_rank, par.world, report=bar.update if report else None,
                      backend=backend, timeout=timeout, **job)
    return launch(train_rank, par.world, report=ProgressBar.print_line if report else None,
                  backend=backend, timeout=timeout, on_line=bar.on_line, **job)


def lr_at(step: int, lr: float, steps: int, warmup: int = 0, decay: str = "none") -> float:
    """The learning rate of step `step` (0-based): linear warmup over the first `warmup` steps
    (lr * (step + 1) / warmup), then constant, or with decay "cosine" half a cosine from lr down to
    lr / 10 at the last step (nanoGPT's and Chinchilla's shape)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if decay == "none" or steps - 1 <= warmup:
        return lr
    progress = (step - warmup) / (steps - 1 - warmup)
    return lr / 10 + (lr - lr / 10) * 0.5 * (1 + math.cos(math.pi * progress))


class NonFiniteLoss(RuntimeError):
    """The loss became inf or nan: training stopped there (the checkpoint, if any, is the last
    finite one). `.result` holds the steps run."""

    def __init__(self, step: int, result: "TrainResult"):
        super().__init__(f"the loss is {result.losses[-1]} at step {step}: training stopped there "
                         "(lower the learning rate, add warmup or clip the gradients)")
        self.step, self.result = step, result


def _merge(ranks: list[RankResult], cfg, global_batch: int, peak, peak_flops: float
           ) -> TrainResult:
    """Every rank's RankResult as one TrainResult: rank 0's losses and times, every rank's memory.
    MFU's denominator, peak_flops: the peak of the devices the job ran on (local CPU ranks share
    one CPU, so its peak counts once; GPU ranks each bring their own)."""
    first = ranks[0]
    steady = first.step_times[1:] or first.step_times
    step = statistics.median(steady)
    tokens = global_batch * cfg.seq_len
    return TrainResult(
        losses=first.losses, step_times=first.step_times, tokens_per_s=tokens / step,
        mfu=cfg.flops_per_token * tokens / step / peak_flops, peak=peak,
        peak_memory=[r.memory for r in ranks], comm_bytes=[r.comm for r in ranks],
        comm_calls=[r.calls for r in ranks], spans=[r.spans for r in ranks],
        val_losses=first.val_losses, grad_norms=first.grad_norms, state_dict=first.state_dict,
        predicted_memory=memory.predict_ranks(cfg, first.par, global_batch),
        step_peak=[r.step_memory for r in ranks], memory_timelines=[r.timeline for r in ranks],
        preempted=first.preempted)


def train_rank(*, cfg: GPTConfig, par: ParallelConfig, steps: int, global_batch: int,
               lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0, data="synthetic",
               return_state: bool = False, save: str | None = None, save_every: int = 0,
               resume: str | None = None, clip: float = 0.0, warmup: int = 0,
               decay: str = "none", eval_every: int = 0, eval_batches: int = 2,
               metrics: str | None = None, tensorboard: str | None = None,
               settings: dict | None = None, peak_flops: float | None = None, report=None,
               device: str | None = None, after_compute=None, watch: bool = True,
               slowdown: float = 1.0, stop_file: str | None = None) -> RankResult:
    """One rank's training run (the arguments are train's); returns its losses, timings, memory,
    bytes sent and (rank 0, with return_state) the single-device weights. Stops after a step whose
    loss is not finite (every rank sees the same global loss, so all stop together).

    report(loss, tokens_per_s), if given, is called by rank 0 after each step (the progress bar).
    after_compute(seconds), if given, is called after each micro-batch's forward and backward (each
    pipeline action) with the seconds it took: a hook for demonstrations (demos_hetero), in place
    of the throttle that `slowdown` makes.
    watch=False: no Tracker watches a step (no step_memory or timeline; a watched step takes 2x)."""
    # long: the loop reads top to bottom, one step's stages in order, each a line or two
    par.check(cfg, global_batch)  # train_layouts and torchrun come here without train()'s checks
    device = device or _device()
    data = data if isinstance(data, dataset.Dataset) else dataset.prepare(data)
    after_compute = after_compute or hardware.throttle(slowdown)  # built here: a job is pickled
    # context parallelism's ranks are replicas of the weights: the DP axis holds dp x cp of them
    mesh, stats = Mesh.build(par.dp * par.cp, par.tp, par.pp, par.stage_tp), comm.CommStats()
    torch.manual_seed(seed)
    # the full model on every rank, then cut: every layout trains the same one
    model = GPT(cfg).to(device)
    resumed = checkpoint.load(resume, cfg) if resume else None
    run = parallelize(model, par, mesh, global_batch=global_batch, lr=lr, weight_decay=weight_decay,
                      stats=stats, after_compute=after_compute, resumed=resumed)
    rows = share.rows(par, mesh, global_batch)
    meter, clock = memory.ActivationMeter(), StepClock(device)
    first = resumed["steps_done"] if resumed else 0
    log = MetricsLog(metrics, tensorboard, active=mesh.rank == 0, append=first > 0)
    out = RankResult([], [], {}, {}, {}, [], device, par=par)
    tokens = global_batch * cfg.seq_len
    for step in range(first, steps):
        heartbeat()  # the launcher's watchdog: this rank is making progress
        clock.start()
        rate = lr_at(step, lr, steps, warmup, decay)
        if warmup or decay != "none":
            run.set_lr(rate)
        # the batch: this step's global batch, the same for every layout
        x, y = dataset.global_batch(data, step, global_batch, cfg.seq_len, cfg.vocab_size, seed)
        # one step, the second (steady: the optimizer's state exists), may be watched (`watch`)
        watched = watch and step == min(first + 1, steps - 1)
        tracker = Tracker(run.memory_tensors()) if watched else None
        run.track(tracker)
        with tracker or contextlib.nullcontext():
            # forward and backward of this rank's micro-batches (pp > 1: in the schedule's order)
            loss, spans = share.forward_backward(run, par, mesh, x, y, rows, device,
                                                 Unmetered() if tracker else meter, after_compute,
                                                 tracker and tracker.phase)
            # gradient sync, clipping, optimizer step: before any other collective (ZeRO-3 reduces)
            with tracker.phase("step") if tracker else contextlib.nullcontext():
                norm = run.sync_and_step(clip)
                if tracker:  # a first step makes AdamW's moments: they are optimizer state
                    tracker.declare("optimizer", *run.memory_tensors()["optimizer"])
        if tracker:
            run.track(None)
            out.step_memory, out.timeline = _peaks(tracker), tracker.timeline
            out.tracked_activations = tracker.most.get("activations", 0)  # (the meter sat out)
        # metrics: the global mean loss; memory at the first step (grads held, optimizer state new)
        if par.dp * par.cp > 1:   # (CP's ranks weigh their tokens' share: apply_cp)
            loss = share.sum_over(loss * rows[2], mesh.dp_group) / (par.dp * par.cp)
        if step == first:
            out.memory = run.tally()
        run.optimizer.zero_grad()
        out.step_times.append(clock.stop())
        out.losses.append(loss)
        out.spans = spans or out.spans
        if norm is not None:
            out.grad_norms.append(norm)
        if not math.isfinite(loss):
            out.stopped = step + 1
            break
        val = None
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            val = share.evaluate(run, par, mesh, data, cfg, global_batch, seed, rows, device,
                                 eval_batches)
            out.val_losses.append((step + 1, val))
        if report and mesh.rank == 0:
            report(loss, tokens / out.step_times[-1])
        seconds = out.step_times[-1]
        if log.active:  # rank 0 with a file to write: the rest measure nothing for it
            log.write(step + 1, dict(loss=loss, val_loss=val, lr=rate, grad_norm=norm,
                                     tokens_per_s=tokens / seconds, step_time=seconds,
                                     mfu=_mfu(cfg, tokens, seconds, peak_flops),
                                     max_memory_mib=max_memory_mib(device)))
        # preemption: every rank learns whether rank 0 saw the stop file
        stop = bool(stop_file) and step + 1 < steps and _stop_asked(stop_file, device)
        # the checkpoint, every save_every steps (0: at the end), at the end and when stopped
        if save and (stop or (step + 1) % (save_every or steps) == 0 or step + 1 == steps):
            checkpoint.write(run, mesh, cfg, step + 1, save, data, settings)
        if stop:
            out.preempted = step + 1
            break
    log.close()
    out.comm, out.calls = dict(stats.bytes_sent), dict(stats.calls)  # not the gather below
    out.memory["activations"] = max(meter.peak, out.tracked_activations)
    if device.startswith("cuda"):  # the ground truth on a GPU, beside the counted categories
        out.memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
    state = checkpoint.final_weights(run, mesh) if return_state and not out.stopped else None
    run.close()
    out.spans = out.spans or (run.dp.spans if run.dp else [])
    out.state_dict = state if mesh.rank == 0 else None
    return out


def _mfu(cfg, tokens: int, seconds: float, peak_flops: float | None) -> float | None:
    return cfg.flops_per_token * tokens / seconds / peak_flops if peak_flops else None


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


def _device() -> str:
    """This rank's device: its GPU under NCCL (launch set it), else the CPU."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return f"cuda:{torch.cuda.current_device()}" if nccl else "cpu"


def _stop_asked(path: str, device: str) -> bool:
    """Whether rank 0 sees the file at `path`, on every rank: one broadcast of one number from rank
    0 over the world (not counted in the training's collectives), so that every rank stops after
    the same step."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    asked = torch.tensor([float(rank0 and os.path.exists(path))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(asked, src=0)
    return bool(asked.item())


def _peaks(tracker: Tracker) -> dict[str, dict]:
    """The tracked step's peaks: {"held": by category at the most model states, buffers and
    activations, "total": at the most of everything, temporaries too}."""
    cuda = {} if tracker.cuda_max_allocated is None else \
        {"cuda_max_allocated": tracker.cuda_max_allocated}  # the allocator's, beside (GPU)
    return {"held": {**tracker.peak, "phase": tracker.peak_phase},
            "total": {**tracker.peak_total, "phase": tracker.peak_total_phase}, **cuda}
