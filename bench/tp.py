"""minipar's Megatron tensor parallelism against PyTorch's DTensor
TP: training step time, fp32, gloo.

One launch per world size t runs every variant side by side in the same t worker processes, each
with its own copy of the same model (same seed, the full single-device init, then cut), the same
batch on every rank (TP splits the model, not the data) and the same AdamW (`make_optimizer`, lr
1e-3, betas 0.9/0.95, weight decay 0.1 on matrices only):

  tp/minipar     apply_tp(GPT, TPGroup.of(None)): minipar's f/g operators on its own ring
                 collectives
  tp/torch       the same layers on the backend's collectives (dist.all_reduce ...)
  tp+sp/torch    the same plus sequence parallelism (LayerNorms and the residual stream cut along
                 the sequence; f/g become all-gather/reduce-scatter), then
                 sync_sequence_parallel_grads
  dtensor        torch.distributed.tensor.parallel.parallelize_module on a 1-D CPU DeviceMesh, the
                 same split as tp/*:  attn.q/k/v, mlp.fc ColwiseParallel; attn.proj, mlp.proj
                 RowwiseParallel; each block's attn PrepareModuleInput(Replicate -> Replicate
                 DTensor) so q, k, v share one input DTensor and one backward all-reduce, as
                 minipar's one f for the three (torchtitan does the same); tok_emb
                 RowwiseParallel(input_layouts= Replicate()) (vocabulary rows, as
                 VocabParallelEmbedding); head ColwiseParallel( output_layouts=Shard(-1)) with the
                 loss under loss_parallel() (the vocab-parallel cross-entropy). LayerNorms and
                 positions stay plain replicated tensors. attn.n_head is divided by t after
                 parallelizing, since the local q/k/v hold n_head/t heads. No sequence parallelism:
                 tp+sp/torch is compared with this same dtensor step.

A first, untimed step checks that the comparison is of one computation: every variant's loss must
equal dtensor's within 1e-5 (same init, same batch: a benchmark of two functions is worthless), its
gradients are compared rank by rank (relative norm; DTensor's rank-local shards), and the
collectives each variant issues in that step are counted (minipar: a comm.CommStats; DTensor: the
functional collectives the profiler sees; "gloo calls": what gloo ran, as the profiler names it: a
ring step is a send and a recv, and gloo runs a reduce-scatter as an all-reduce).
Then, after warm-up steps, a repetition runs one step of each variant (forward with the loss,
backward (+ the SP gradient sync), optimizer step, zero_grad) from a barrier, starting with a
different variant each time; its time is the slowest rank's. Times are medians over every
repetition of every launch; "/ dtensor" is the median of variant/dtensor over repetitions run back
to back, "per launch" its range launch by launch; forward, backward and optimizer are each phase's
median over all ranks.
"""
from __future__ import annotations

import sys
import time
import warnings
from collections import Counter

import common  # bench/ is on sys.path
import torch
import torch.distributed as dist
from common import RESULTS, add_timing_arguments, main

import minipar
from minipar import comm, data
from minipar.model import GPT, GPTConfig, cross_entropy
from minipar.tensor_parallel import (TPGroup, apply_tp, sync_sequence_parallel_grads,
                                     vocab_parallel_cross_entropy)
from minipar.train import make_optimizer

DEFAULTS = dict(worlds=(2, 4), model="small-cpu", n_head=8, batch=4, reps=8, warmup=2, launches=2,
                threads=1)
VARIANTS = ("tp/minipar", "tp/torch", "tp+sp/torch", "dtensor")
PEER = "dtensor"
LR, WEIGHT_DECAY = 1e-3, 0.1


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULTS["worlds"]),
                        help="TP sizes t")
    parser.add_argument("--model", default=DEFAULTS["model"], help="GPTConfig preset")
    parser.add_argument("--n-head", dest="n_head", type=int, default=DEFAULTS["n_head"],
                        help="override the preset's heads (every t must divide it; "
                             "0: the preset's)")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"],
                        help="sequences, the same on every rank")
    add_timing_arguments(parser, DEFAULTS)


def model_config(s: dict) -> GPTConfig:
    return GPTConfig.preset(s["model"], **({"n_head": s["n_head"]} if s["n_head"] else {}))


# ----------------------------------------------------------------------------- inside a worker


def dtensor_plan(cfg: GPTConfig) -> dict:
    """parallelize_module's plan: the split of apply_tp, in DTensor's styles (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(cfg.n_layer):
        plan |= {f"blocks.{i}.attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                                        desired_input_layouts=(Replicate(),)),
                 **{f"blocks.{i}.attn.{name}": ColwiseParallel() for name in ("q", "k", "v")},
                 f"blocks.{i}.attn.proj": RowwiseParallel(),
                 f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()}
    return plan


class _Run:
    """One variant: forward(x, y) -> loss, backward(), step() = optimizer step then zero_grad."""

    def __init__(self, name: str, cfg: GPTConfig, mesh):
        torch.manual_seed(0)
        self.model, self.tp = GPT(cfg), None
        self.stats = comm.CommStats()  # what minipar's TP sends
        if name == "dtensor":
            from torch.distributed.tensor.parallel import parallelize_module
            parallelize_module(self.model, mesh, dtensor_plan(cfg))
            for block in self.model.blocks:
                block.attn.n_head //= mesh.size()  # the local q, k, v hold n_head / t heads
        else:
            kind, collectives = name.split("/")
            self.tp = TPGroup.of(None, kind == "tp+sp", collectives, self.stats)
            apply_tp(self.model, self.tp)
        self.optimizer = make_optimizer(self.model, LR, WEIGHT_DECAY)

    def forward(self, x, y) -> torch.Tensor:
        if self.tp:
            return vocab_parallel_cross_entropy(self.model(x), y, self.tp)
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():  # the cross-entropy on the vocab-sharded logits DTensor
            return cross_entropy(self.model(x), y)

    def backward(self, loss) -> None:
        if self.tp:
            loss.backward()
            if self.tp.sequence_parallel:
                sync_sequence_parallel_grads(self.model, self.tp)
            return
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():  # its backward must run under it too
            loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def local_grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradient of each parameter, as the shard it holds
        (DTensor's in the param's layout)."""
        out = {}
        for name, p in self.model.named_parameters():
            g = p.grad
            if hasattr(g, "to_local"):  # e.g. the embedding's comes back Replicate
                                        #   for a Shard(0) weight
                g = g.redistribute(placements=p.placements).to_local()
            out[name] = g.detach().clone()
        return out


def _check_step(run: _Run, x, y) -> tuple[float, dict, dict]:
    """The untimed first step: (loss, local gradients, {"logical": collectives called, "gloo": the
    backend's operations}) in forward + backward. minipar's collectives are counted by the run's
    CommStats; DTensor's are the functional collectives the profiler sees (it also sees those issued
    inside DTensor's op handlers, such as loss_parallel's, which a dispatch mode would miss)."""
    from torch.autograd.profiler import profile
    stats = run.stats  # empty so far: this is the run's first step
    with profile(use_kineto=False) as prof:
        loss = run.forward(x, y)
        run.backward(loss)
    grads = run.local_grads()
    run.step()
    ops = Counter(e.name for e in prof.function_events)
    gloo = {k.removeprefix("gloo:"): v for k, v in ops.items() if k.startswith("gloo:")}
    logical = {k.removeprefix("torch_"): v for k, v in stats.calls.items() if v} if run.tp else {
        k.removeprefix("_c10d_functional::"): v for k, v in ops.items()
        if k.startswith("_c10d_functional::") and "wait" not in k and "wrap" not in k}
    return loss.item(), grads, {"logical": logical, "gloo": gloo,
                                "events": len(prof.function_events)}


def worker(cfg: GPTConfig, batch: int, reps: int, warmup: int, threads: int) -> dict:
    """On every rank: {"step"/"forward"/"backward"/"opt": {variant: [seconds of each timed step]},
    "losses": {variant: [loss of every step]}, "grad_diff": {variant: rel. diff from dtensor's},
    "calls": {variant: _check_step's counts}}."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    if threads:
        torch.set_num_threads(threads)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # all of it, every rank
    x, y = data.global_batch("synthetic", 0, batch, cfg.seq_len, cfg.vocab_size)
    runs = {name: _Run(name, cfg, mesh) for name in VARIANTS}
    losses, grads, calls = {}, {}, {}
    for name, run in runs.items():
        loss, grads[name], calls[name] = _check_step(run, x, y)
        losses[name] = [loss]
    ref = grads[PEER]
    flat = lambda g: torch.cat([t.flatten() for t in g.values()]).double()  # noqa: E731
    grad_diff = {name: ((flat(g) - flat(ref)).norm() / flat(ref).norm()).item() for name,
                 g in grads.items()}
    times = {phase: {name: [] for name in VARIANTS}
             for phase in ("step", "forward", "backward", "opt")}
    for i in range(warmup + reps):
        k = i % len(VARIANTS)
        for name in VARIANTS[k:] + VARIANTS[:k]:
            run = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            loss = run.forward(x, y)
            t1 = time.perf_counter()
            run.backward(loss)
            t2 = time.perf_counter()
            run.step()
            t3 = time.perf_counter()
            losses[name].append(loss.item())
            if i >= warmup:
                for phase, dt in (("step", t3 - t0), ("forward", t1 - t0), ("backward", t2 - t1),
                                  ("opt", t3 - t2)):
                    times[phase][name].append(dt)
    return {**times, "losses": losses, "grad_diff": grad_diff, "calls": calls}


# ----------------------------------------------------------------------------- in the caller


def run(args=None, out_dir=RESULTS, **overrides) -> str:
    """Run the comparison; write tp.md and tp.png to out_dir; return the markdown table.

    run(args, out_dir) with parsed arguments (bench/run.py), or
    run(worlds=(2,), reps=4) from Python.
    """
    import tp_report as report  # here, not at the top: it reads VARIANTS from this module

    s = common.settings(DEFAULTS, args, overrides)
    out_dir, since = common.start(out_dir)
    cfg = model_config(s)
    for t in s["worlds"]:
        for field in ("n_head", "d_model", "vocab_size", "seq_len"):
            if getattr(cfg, field) % t:
                raise ValueError(f"t = {t} must divide the model's {field} "
                                 f"({getattr(cfg, field)}): see --n-head")
    def run(world: int, _: int) -> list:  # one launch of `world` ranks
        return minipar.launch(worker, world, cfg, s["batch"], s["reps"], s["warmup"], s["threads"],
                              timeout=1800, on_line=_quiet)

    launches = common.launch_rounds(s["worlds"], s["launches"], run)
    rows = [row for world, runs in launches.items() for row in report.summarise(world, runs)]
    md, checks = report.table(rows), report.sanity(rows)
    verdict, notes = report.verdicts(rows), report.findings(rows)
    command = (f"python bench/run.py tp --worlds {' '.join(map(str, s['worlds']))} --model "
               f"{s['model']} "
               f"--n-head {s['n_head']} --batch {s['batch']} --reps {s['reps']} --warmup "
               f"{s['warmup']} "
               f"--launches {s['launches']} --threads {s['threads']}")
    setup = (f"Model `{s['model']}` with n_head = {cfg.n_head} (l {cfg.n_layer}, h {cfg.d_model}, "
             "V "
             f"{cfg.vocab_size}, s {cfg.seq_len}: {cfg.num_params:,} parameters, the same model "
             "for every t); "
             f"{s['batch']} x {cfg.seq_len} tokens per step, the same on every rank.")
    (out_dir / "tp.md").write_text(
        "# tensor parallelism: minipar vs DTensor (gloo), "
        f"fp32\n\n{__doc__.strip()}\n\n{setup}\n\n{checks}\n\n"
        f"{md}\n\n{verdict}\n\n{notes}\n\n![step time by phase](tp.png)\n\n"
        f"{common.footer(s['threads'], since, command)}")
    report.plot(rows, s, out_dir / "tp.png")
    return f"{setup}\n\n{checks}\n\n{md}\n\n{verdict}\n\n{notes}"


def _quiet(rank: int, line: str) -> bool:
    """Hide the profiler's start/stop lines (_check_step) from the workers' output."""
    return "profiler_st" in line


if __name__ == "__main__":  # python bench/tp.py [options], the same as python
                            #   bench/run.py tp [options]
    main(sys.modules[__name__])
