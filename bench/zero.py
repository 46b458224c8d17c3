"""minipar ZeRO against PyTorch's: ZeRO-3 vs FSDP2, ZeRO-1 vs
ZeroRedundancyOptimizer over DDP; fp32, gloo.

Six variants train the same model (same seed) on the same fixed batch, in the same worker processes:

  zero3/minipar, zero3/torch   minipar.zero.Zero3 (its own ring / the backend's collectives)
  fsdp2                        torch.distributed.fsdp.fully_shard on each block, then the root, on a
                               CPU device mesh, with torch.optim.AdamW on the sharded parameters
  zero1/minipar, zero1/torch   minipar.zero.ZeroOptimizer(stage=1): it reduce-scatters the gradients
                               itself
  ddp+zero-r                   torch DDP (default buckets) +
                               torch.distributed.optim.ZeroRedundancyOptimizer
                               around AdamW: PyTorch's ZeRO-1 (DDP all-reduces,
                               ZeRO-R shards the state)

All use AdamW(lr 1e-3, betas 0.9/0.95, weight decay 0.1 on matrices only). Step time: a repetition
runs one step of each variant (forward, backward, gradient sync, optimizer step, zero_grad) from a
barrier, starting with a different variant each time, after warm-up steps; its time is the slowest
rank's. Times are medians over every repetition of every launch; the ratio is the median of
variant/peer over repetitions run back to back (peer: fsdp2 for ZeRO-3, ddp+zero-r for ZeRO-1), "per
launch" its range launch by launch. "in step()": the median time (all ranks) in the optimizer step
and zero_grad, after backward; it holds ZeRO-1's reduce-scatter and all-gather and ZeRO-R's
broadcasts (DDP, FSDP2 and Zero3 sync the gradients in backward).

Memory (first launch only, before the timed steps, one variant at a time): there are no CPU
allocator statistics, so every variant is measured by PyTorch's
`torch.distributed._tools.mem_tracker.MemTracker`, a dispatch mode that sees every tensor storage an
operator creates and its release. The model, the wrapper and the optimizer are built inside the
tracker (so persistent buffers such as DDP's buckets and minipar's reused ring scratch space are
seen from birth); one step runs, then the peak is reset and the second step is measured (later steps
peak the same, to the byte). "peak" is the largest total of live storages during that step, "after
forward" the total just before backward, "between steps" what is still held after zero_grad. "full
params held after forward": the bytes of the storages that the parameters of each module had while
it ran forward that are still alive when forward ends (weak references taken by forward pre-hooks):
gathered parameters not yet really freed, and anything not sharded. A dispatch mode is per thread:
Zero3 runs its all-gathers and reduce-scatters on a communication thread, which the tracker would
not see, so for this measurement only its executor is replaced by one that runs each job at once in
the calling thread, as if the communication thread started every job the moment it is queued (a
prefetched unit then exists from the prefetch request on, the earliest it can in a real run).
Not counted, for any variant: gloo's internal buffers, Python objects, the allocator's slack. Memory
columns are the fullest rank's.
Sanity: every variant's loss at every step (rank-local, same rows on a rank) is compared with the
peer's; the first step's must be equal, later ones differ by reduction order only.
"""
from __future__ import annotations

import gc
import sys
import time
import warnings
import weakref
from concurrent.futures import Future

import common  # bench/ is on sys.path
import torch
import torch.distributed as dist
from common import RESULTS, add_timing_arguments, main
from torch.distributed.tensor import DTensor

import minipar
from minipar import data
from minipar.model import GPT, GPTConfig, cross_entropy
from minipar.train import make_optimizer
from minipar.zero import ZeroOptimizer
from minipar.zero3 import Zero3

DEFAULTS = dict(worlds=(2, 4), model="small-cpu", batch=4, reps=8, warmup=2, launches=2, threads=1)
VARIANTS = ("zero3/minipar", "zero3/torch", "fsdp2", "zero1/minipar", "zero1/torch", "ddp+zero-r")
PEER = {"zero3/minipar": "fsdp2", "zero3/torch": "fsdp2", "fsdp2": "fsdp2",
        "zero1/minipar": "ddp+zero-r", "zero1/torch": "ddp+zero-r", "ddp+zero-r": "ddp+zero-r"}
LR, WEIGHT_DECAY, BETAS = 1e-3, 0.1, (0.9, 0.95)


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULTS["worlds"]),
                        help="world sizes")
    parser.add_argument("--model", default=DEFAULTS["model"], help="GPTConfig preset")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per rank")
    add_timing_arguments(parser, DEFAULTS)


# ----------------------------------------------------------------------------- inside a worker


class _Inline:
    """An executor that runs each job at once, in the calling thread (Zero3's memory step only)."""

    def submit(self, fn, *args):
        done = Future()
        done.set_result(fn(*args))
        return done

    def shutdown(self, wait: bool = True) -> None:
        pass


class _Run:
    """One variant: `module` to call, and `step()` = optimizer step then zero_grad."""

    def __init__(self, name: str, cfg: GPTConfig, mesh):
        torch.manual_seed(0)
        self.model = self.module = GPT(cfg)
        self.zero3 = None
        kind, _, collectives = name.partition("/")
        if kind == "zero3":
            self.optimizer = self.zero3 = Zero3(self.model, None, LR, WEIGHT_DECAY, BETAS,
                                                collectives=collectives)
        elif kind == "zero1":
            self.optimizer = ZeroOptimizer(self.model, None, 1, LR, WEIGHT_DECAY, BETAS,
                                           collectives=collectives)
        elif name == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            self.optimizer = make_optimizer(self.model, LR, WEIGHT_DECAY)
        elif name == "ddp+zero-r":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel
            self.module = DistributedDataParallel(self.model)
            # same groups as the others
            groups = make_optimizer(self.model, LR, WEIGHT_DECAY).param_groups
            self.optimizer = ZeroRedundancyOptimizer(
                [dict(params=g["params"], weight_decay=g["weight_decay"]) for g in groups],
                optimizer_class=torch.optim.AdamW, lr=LR, betas=BETAS)
        else:
            raise ValueError(f"unknown variant {name!r}")

    def forward(self, x, y) -> torch.Tensor:
        return cross_entropy(self.module(x), y)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def close(self) -> None:
        if self.zero3:
            self.zero3.close()


def _measure_memory(name: str, cfg, mesh, x, y) -> dict:
    """This rank's bytes in one steady step: {"peak", "after_forward",
    "between", "gathered"} (docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    gc.collect()
    tracker = MemTracker()
    total = lambda kind: sum(snap["Total"] for snap in tracker.get_tracker_snapshot(kind).values())
    with tracker:
        run = _Run(name, cfg, mesh)
        if run.zero3:
            run.zero3._comm.shutdown()
            run.zero3._comm = _Inline()
        run.forward(x, y).backward()  # a first step makes the optimizer state; peaks are the same
                                      #   from the second on
        run.step()
        tracker.reset_mod_stats()  # MemTracker refuses a second forward of a module otherwise
        # the peak of the second step only
        tracker._peak_mem.clear(), tracker._peak_mem_snap.clear()
        storages, hooks = _watch_parameter_storages(run.model)
        loss = run.forward(x, y)
        after_forward = total("current")
        gathered = sum(st.nbytes() for st in (ref() for ref in storages.values()) if st is not None)
        loss.backward()
        del loss
        run.step()
        time.sleep(0.05)  # gloo's worker thread drops its reference to a
                          #   finished collective's tensors
        dist.barrier()    # a moment after the caller's wait returns: let it,
                          #   or "between" may count them
        out = dict(peak=total("peak"), after_forward=after_forward, between=total("current"),
                   gathered=gathered)
    for hook in hooks:
        hook.remove()
    run.close()
    del run
    gc.collect()
    return out


def _watch_parameter_storages(model):
    """Weak references to the storages every module's parameters have while it runs its forward.

    Read after forward: the full parameters still held then (gathered ones that were not freed, or
    were freed in name only, and any that are never sharded), whatever the implementation."""
    storages = {}

    def note(module, args):
        for p in module.parameters(recurse=False):
            st = (p.to_local() if isinstance(p, DTensor) else p).untyped_storage()
            if st.nbytes():
                storages.setdefault(st.data_ptr(), weakref.ref(st))

    hooks = [m.register_forward_pre_hook(note) for m in model.modules()
             if any(True for _ in m.parameters(False))]
    return storages, hooks


def worker(model: str, batch: int, reps: int, warmup: int, threads: int, memory: bool) -> dict:
    """On every rank: {"step", "opt": {variant: [seconds of each timed step, of its run.step()]},
    "losses": {variant: [loss of every step]}, "memory": {variant:
    _measure_memory's} (if memory)}."""
    # FSDP2 on our logits: no in-place
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    # MemTracker on None grads
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")
    if threads:
        torch.set_num_threads(threads)
    from torch.distributed.device_mesh import init_device_mesh

    cfg = GPTConfig.preset(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    x, y = data.global_batch("synthetic", 0, batch * world, cfg.seq_len, cfg.vocab_size)
    x, y = data.shard(x, rank, world), data.shard(y, rank, world)
    mem = {name: _measure_memory(name, cfg, mesh, x, y) for name in VARIANTS} if memory else {}
    runs = {name: _Run(name, cfg, mesh) for name in VARIANTS}
    step, opt = {name: [] for name in VARIANTS}, {name: [] for name in VARIANTS}
    losses = {name: [] for name in VARIANTS}
    for i in range(warmup + reps):
        k = i % len(VARIANTS)
        for name in VARIANTS[k:] + VARIANTS[:k]:
            run = runs[name]
            dist.barrier()
            start = time.perf_counter()
            loss = run.forward(x, y)
            loss.backward()
            backward_done = time.perf_counter()
            run.step()
            end = time.perf_counter()
            losses[name].append(loss.item())
            if i >= warmup:
                step[name].append(end - start)
                opt[name].append(end - backward_done)
    for run in runs.values():
        run.close()
    return {"step": step, "opt": opt, "losses": losses, "memory": mem}


# ----------------------------------------------------------------------------- in the caller


def run(args=None, out_dir=RESULTS, **overrides) -> str:
    """Run the comparison; write zero.md and zero.png to out_dir; return the markdown table.

    run(args, out_dir) with parsed arguments (bench/run.py), or
    run(worlds=(2,), reps=4) from Python.
    """
    import zero_report as report  # here, not at the top: it reads VARIANTS from this module

    s = common.settings(DEFAULTS, args, overrides)
    out_dir, since = common.start(out_dir)
    def run(world: int, i: int) -> list:  # one launch of `world` ranks
        return minipar.launch(worker, world, s["model"], s["batch"], s["reps"], s["warmup"],
                              s["threads"], i == 0, timeout=1800)

    launches = common.launch_rounds(s["worlds"], s["launches"], run)
    rows = [row for world, runs in launches.items() for row in report.summarise(world, runs)]
    md = report.table(rows)
    verdict = report.verdicts(rows)
    cfg = GPTConfig.preset(s["model"])
    command = (f"python bench/run.py zero --worlds {' '.join(map(str, s['worlds']))} --model "
               f"{s['model']} "
               f"--batch {s['batch']} --reps {s['reps']} --warmup {s['warmup']} --launches "
               f"{s['launches']} "
               f"--threads {s['threads']}")
    setup = (f"Model `{s['model']}`: {cfg.num_params:,} parameters "
             f"({4 * cfg.num_params / 2**20:.1f} MiB in fp32, "
             f"P below); {s['batch']} x {cfg.seq_len} tokens per rank.")
    (out_dir / "zero.md").write_text(
        "# ZeRO: minipar vs FSDP2 and ZeroRedundancyOptimizer (gloo), "
        f"fp32\n\n{__doc__.strip()}\n\n{setup}\n\n"
        f"{md}\n\n{verdict}\n\n{report.findings(rows, cfg)}![step time and memory](zero.png)\n\n"
        f"{common.footer(s['threads'], since, command)}")
    report.plot(rows, s, out_dir / "zero.png")
    return f"{setup}\n\n{md}\n\n{verdict}"


if __name__ == "__main__":  # python bench/zero.py [options], the same as python
                            #   bench/run.py zero [options]
    main(sys.modules[__name__])
