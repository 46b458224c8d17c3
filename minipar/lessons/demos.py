"""Small worker functions the lessons run on several ranks: `minipar.launch(demos.hello, 4)`.

They live in a module because `launch` starts fresh processes that import the function by name (a
function defined in a notebook cannot be imported). Each one reads its rank from torch.distributed,
prints what a lesson wants to show (it comes back as "[rank r] ..."), and returns plain data (lists,
dicts, CPU tensors) for the notebook to check. Tensors live on
the rank's GPU under NCCL, else on CPU.
"""
from __future__ import annotations

import os
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from minipar import comm, data
from minipar.data_parallel import DataParallelBucket, DataParallelNaive
from minipar.model import GPT, MLP, GPTConfig, cross_entropy
from minipar.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPGroup
from minipar.train import make_optimizer, train_layouts
from minipar.zero3 import Zero3


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL (launch set it), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync_device() -> None:
    """Wait for queued GPU work, so a timer measures it (nothing to wait for on CPU)."""
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def synthetic_batch(cfg, per_rank_batch: int, threads: int | None = None):
    """A timed worker's start: `threads` intra-op threads (None keeps launch's), the GPTConfig (or
    preset name) `cfg`, and this rank's share of synthetic global batch 0: (cfg, device, x, y)."""
    if threads:
        torch.set_num_threads(threads)
    cfg = GPTConfig.preset(cfg) if isinstance(cfg, str) else cfg
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    x, y = data.global_batch("synthetic", 0, per_rank_batch * world, cfg.seq_len, cfg.vocab_size)
    return cfg, device, data.shard(x, rank, world).to(device), data.shard(y, rank, world).to(device)


def _in_turn(text: str) -> None:
    """Print `text` on every rank, rank 0 first: a barrier between
    turns keeps the lines in order."""
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            print(text, flush=True)
        dist.barrier()


# ----------------------------------------------------------------------------- lesson 00


def hello() -> tuple[int, int, int]:
    """Say hello from this rank; return (rank, world size, process id)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"hello from rank {rank} of {world}, process {os.getpid()}, backend {dist.get_backend()}")
    return rank, world, os.getpid()


def collective(name: str, length: int = 4, src: int = 0) -> dict:
    """Run one collective, minipar's and torch.distributed's, on a rank-dependent tensor.

    Rank r starts with [10r, 10r+1, ...] (so each value says where it came from), prints what it
    holds before and after, and returns {"before", "minipar", "torch"} as CPU tensors.
    name: "all_reduce", "reduce_scatter", "all_gather" or "broadcast" (from global rank src).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    x = (torch.arange(length) + 10 * rank).float().to(rank_device())
    if name == "all_reduce":
        ours, ref = comm.all_reduce(x.clone()), x.clone()
        dist.all_reduce(ref)
    elif name == "broadcast":
        ours, ref = comm.broadcast(x.clone(), src), x.clone()
        dist.broadcast(ref, src)
    elif name == "all_gather":
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
        ours, ref = comm.all_gather(x), torch.cat(parts)
    elif name == "reduce_scatter":
        ours = comm.reduce_scatter(x)
        if length % n == 0:
            ref = x.new_empty(length // n)
            dist.reduce_scatter_tensor(ref, x)
        else:  # torch needs equal parts: sum everything, then take this rank's tensor_split part
            ref = x.clone()
            dist.all_reduce(ref)
            ref = torch.tensor_split(ref, n)[rank]
    else:
        raise ValueError(f"unknown collective {name!r}")
    _in_turn(f"before {x.tolist()}  ->  after {ours.tolist()}")
    return {"before": x.cpu(), "minipar": ours.cpu(), "torch": ref.cpu()}


def ring_trace(length: int | None = None) -> dict:
    """Run comm.all_reduce with an observer that records what this rank holds after every ring step.

    Rank r contributes 2**r to every element (default length: one element a chunk), so a value is
    a bit mask of the ranks summed into it (0b0101: ranks 0 and 2). The observer sees each step of
    comm's own ring (`comm._ring`): the chunk that arrived and its new value. Returns {"steps":
    [(phase, step, chunk)] in the order observed, "states": per step (start first) the values this
    rank holds of every chunk (its own input until something arrives), "all_reduce": the result}.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.full((length or n,), 2 ** rank, dtype=torch.int64, device=rank_device())
    held = [c.tolist() for c in torch.tensor_split(x, n)]  # this rank's view of each chunk
    steps, states = [], [list(held)]

    def observe(phase: str, step: int, chunk: int, value: torch.Tensor) -> None:
        held[chunk] = value.tolist()  # a copy: value is the ring's buffer
        steps.append((phase, step, chunk))
        states.append(list(held))

    result = comm.all_reduce(x.clone(), observe=observe)
    return {"steps": steps, "states": states, "all_reduce": result.tolist()}


def count_bytes(lengths: list[int]) -> list[dict]:
    """Bytes this rank sends in each of comm's collectives, for fp32 tensors of each length.

    all_reduce and reduce_scatter take a tensor of `length` elements; all_gather takes `length`
    elements per rank, so its output (the S of its formula) has world * length. Returns, per length,
    {collective: bytes sent}.
    """
    out = []
    for length in lengths:
        x = torch.ones(length, device=rank_device())
        stats = comm.CommStats()  # counts what the calls it is handed to send
        comm.all_reduce(x, stats=stats)
        comm.reduce_scatter(x, stats=stats)
        comm.all_gather(x, stats=stats)
        out.append(dict(stats.bytes_sent))
    return out


def time_all_reduce(sizes: list[int], reps: int = 5) -> dict[str, list[float]]:
    """Best-of-`reps` seconds of an fp32 all-reduce of each size (bytes):
    minipar's ring and the backend's.

    Every rank waits at a barrier before each repetition, so they start together; one warm-up call
    per size is not timed. The minimum, not the mean, because on a shared machine another process
    can stall a rank for a scheduler tick (4 ms) in any repetition. Returns {"minipar": [...],
    "<backend>": [...]}, one entry per size.
    """
    scratch = comm.Scratch()  # the ring's receive space, kept between calls as training keeps it
    ring = lambda x: comm.all_reduce(x, scratch=scratch)  # noqa: E731
    impls = {"minipar": ring, dist.get_backend(): dist.all_reduce}
    times = {name: [] for name in impls}
    for size in sizes:
        x = torch.ones(size // 4, device=rank_device())
        for name, fn in impls.items():
            fn(x)
            samples = []
            for _ in range(reps):
                dist.barrier()
                sync_device()
                start = time.perf_counter()
                fn(x)
                sync_device()
                samples.append(time.perf_counter() - start)
            times[name].append(min(samples))
    return times


# ----------------------------------------------------------------------------- lesson 01

DP_VARIANTS = {  # name -> what trains one step; every variant sees the
                 #   same weights and the same batch
    "local": "no gradient sync at all: the compute alone, the floor the others approach",
    "ddp": "torch.nn.parallel.DistributedDataParallel, bucket_cap_mb = bucket_mb",
    "bucketed/minipar": "minipar DataParallelBucket, minipar's ring on a communication thread",
    "bucketed/torch": "minipar DataParallelBucket, the backend's async all-reduce",
    "naive/minipar": "minipar DataParallelNaive, one ring all-reduce per parameter after backward",
    "naive/torch": "minipar DataParallelNaive, one backend all-reduce per parameter after backward",
}


def compare_ddp(cfg="small-cpu", per_rank_batch: int = 8, bucket_mb: float = 2.0, reps: int = 8,
                warmup: int = 2, threads: int | None = None, variants=tuple(DP_VARIANTS)) -> dict:
    """Time a training step of each data-parallel variant (`DP_VARIANTS`) side by side, interleaved.

    cfg is a GPTConfig or a preset name. Each variant has its own copy of the model (same seed) and
    AdamW; every rank takes `per_rank_batch` rows of one fixed synthetic batch. A repetition runs
    one step of each variant, starting at a different one each time; each step starts at a barrier
    and covers forward, backward, gradient sync, optimizer step. threads: intra-op threads per rank
    (None keeps launch's choice). Returns this rank's {"step": {variant: [seconds per repetition]},
    "sync": {variant: [seconds in finish(): communication that backward did not hide]},
    "grad_diff": {variant: relative norm difference of its first averaged gradients from DDP's},
    "tokens": tokens this rank trains on per step}.
    """
    cfg, device, x, y = synthetic_batch(cfg, per_rank_batch, threads)
    runs = {name: _dp_variant(name, cfg, device, bucket_mb) for name in variants}
    step, wait, grads = ({name: [] for name in variants} for _ in range(3))
    for i in range(warmup + reps):
        k = i % len(variants)
        for name in variants[k:] + variants[:k]:
            wrapped, model, sync, optimizer = runs[name]
            dist.barrier()
            sync_device()
            start = time.perf_counter()
            cross_entropy(wrapped(x), y).backward()
            backward_done = time.perf_counter()
            if sync:
                sync.finish()
            sync_device()
            synced = time.perf_counter()
            if i == 0:  # the first step: every model still holds the initial weights
                grads[name] = torch.cat([p.grad.flatten()
                                         for p in model.parameters()]).double().cpu()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync_device()
            if i >= warmup:
                step[name].append(time.perf_counter() - start)
                wait[name].append(synced - backward_done)
    for _, _, sync, _ in runs.values():
        if sync:
            sync.close()
    ref = grads.get("ddp")
    diff = {name: ((g - ref).norm() / ref.norm()).item() for name, g in grads.items()
            if ref is not None and name != "local"}
    return {"step": step, "sync": wait, "grad_diff": diff, "tokens": per_rank_batch * cfg.seq_len}


def _dp_variant(name: str, cfg, device, bucket_mb: float) -> tuple:
    """(what forward runs on, the model, its gradient sync or None, AdamW) of a DP_VARIANTS name."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    wrapped, sync = model, None
    if name == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_mb)
    elif name != "local":
        mode, collectives = name.split("/")  # the naive one, or the bucketed one
        sync = DataParallelNaive(model, None, collectives) if mode == "naive" else \
            DataParallelBucket(model, None, int(bucket_mb * 2**20), collectives)
    return wrapped, model, sync, make_optimizer(model, 1e-3, 0.0)


def slowest_rank(by_rank: list[dict], key: str = "step") -> dict[str, list[float]]:
    """From `compare_ddp`'s results by rank: {variant: each repetition's
    time on its slowest rank}."""
    return {name: [max(ts) for ts in zip(*(r[key][name] for r in by_rank))]
            for name in by_rank[0][key]}


# ----------------------------------------------------------------------------- lesson 03


def zero_memory(cfg, variants: list, steps: int = 2, global_batch: int = 8) -> list[dict]:
    """Train `cfg` under each ParallelConfig of `variants` (all of this world's dp) in this one job
    (`train_layouts`). Returns, per variant, this rank's RankResult: .memory {category: bytes},
    .comm {collective: bytes sent}, .calls {collective: calls}, as `minipar.train` measures them.
    Runs in the caller's process too when every variant has dp = 1.
    """
    return train_layouts(variants, cfg=cfg, steps=steps, global_batch=global_batch)


def zero3_trace(cfg="tiny", per_rank_batch: int = 2, warmup: int = 1,
                     collectives: str = "minipar") -> dict:
    """One ZeRO-3 training step with every gather and free of `zero.Zero3` recorded, on this rank,
    after `warmup` steps of the same model that are not (a process's first step makes AdamW's
    moments and pays its one-time costs); every step starts at a barrier, so that the ranks start
    it together (a rank that starts late makes the others wait in their first all-gather).

    Zero3 does not log its events, so this wraps three methods of the one instance it builds
    (`_recorded`): `_start_gather` (an all-gather is launched: a unit's full buffer is allocated),
    `_free` (it is released) and `_gather` (the compute waits for a unit to arrive). Returns
    {"units": names in forward order, "unit_bytes": each unit's gathered size,
     "events": [(what, unit, time, gathered bytes after)] with what "gather" or "free",
     "waits": [(unit, start, end)] time blocked in _gather, "phases": [(what, start, end)] for
     forward, backward and step, "peak": the recorded step's Zero3.peak_gathered_bytes,
     "warmup_phases": each warm-up step's phases}; times in perf_counter seconds."""
    cfg = GPTConfig.preset(cfg) if isinstance(cfg, str) else cfg
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    names = {id(m): name for name, m in model.named_modules()}
    zero = Zero3(model, None, collectives=collectives)
    events, waits, phases = [], [], []
    for method, what in (("_start_gather", "gather"), ("_free", "free"), ("_gather", "wait")):
        setattr(zero, method, _recorded(zero, getattr(zero, method), what, events, waits))
    for step in range(warmup + 1):
        x, y = data.global_batch("synthetic", step, per_rank_batch * world, cfg.seq_len,
                                 cfg.vocab_size)
        x, y = data.shard(x, rank, world).to(device), data.shard(y, rank, world).to(device)
        events.clear()  # keep the last step's only
        waits.clear()
        zero.peak_gathered_bytes = zero.gathered_bytes  # 0: nothing is gathered between steps
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
        t3 = time.perf_counter()
        phases.append([("forward", t0, t1), ("backward", t1, t2), ("step", t2, t3)])
    zero.close()
    return {"units": [names[id(u.module)] for u in zero.units],
            "unit_bytes": [u.mine.params.numel() * world * u.mine.params.element_size()
                           for u in zero.units],
            "events": events, "waits": waits, "peak": zero.peak_gathered_bytes,
            "phases": phases[-1], "warmup_phases": phases[:-1]}


def _recorded(zero: Zero3, original, what: str, events: list, waits: list):
    """`original` (a bound method of `zero` taking a unit's index), recording each call: "wait"
    appends (unit, start, end) to `waits`; "gather" and "free" append (what, unit, start, gathered
    bytes after) to `events` when the gathered bytes changed (it did gather or free something).
    Set as an instance attribute, it shadows the class's method: Zero3's hooks call it."""
    def recorded(i: int) -> None:
        before, start = zero.gathered_bytes, time.perf_counter()
        original(i)
        if what == "wait":
            waits.append((i, start, time.perf_counter()))
        elif zero.gathered_bytes != before:
            events.append((what, i, start, zero.gathered_bytes))
    return recorded


# ----------------------------------------------------------------------------- lesson 04


def tp_mlp(cfg="tiny", batch: int = 2, seed: int = 0) -> dict:
    """The MLP, fc column-parallel and proj row-parallel over this world,
    on one input, with and without SP.

    Every rank builds the single-device MLP and the same input x and upstream gradient dy from
    `seed` (the reference, computed locally), cuts its blocks, and runs forward and backward, the TP
    group counting into a CommStats (each pass's counts told apart). Returns {"partial": Z_r =
    GeLU(x A_r) B_r, this rank's part before g (no bias), "partial_grad": dx through this rank's
    blocks alone, before f's all-reduce, "bias": B's bias, added once after g, and for sp in (False,
    True) {"out", "grad": what the parallel layers give, "ref", "ref_grad": the single-device ones
    (with SP: this rank's tokens of each), "forward", "backward": {collective: calls},
    "forward_bytes", "backward_bytes": {collective: bytes sent}}}.
    """
    torch.set_num_threads(1)
    cfg = GPTConfig.preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    full, x = MLP(cfg), torch.randn(batch, cfg.seq_len, cfg.d_model)
    dy = torch.randn_like(x)
    xf = x.clone().requires_grad_()
    (ref := full(xf)).backward(dy)
    tp = TPGroup.of(None)
    fc, proj = ColumnParallelLinear(full.fc, tp), RowParallelLinear(full.proj, tp)
    xp = x.clone().requires_grad_()  # this rank's blocks alone, no f and no g: what each rank adds
    partial = F.linear(F.gelu(F.linear(xp, fc.weight, fc.bias), approximate="tanh"), proj.weight)
    partial.backward(dy)
    out = dict(partial=partial.detach(), partial_grad=xp.grad, bias=full.proj.bias.detach())
    for sp in (False, True):
        stats = comm.CommStats()  # what the group sends: forward's, then forward's and backward's
        tp = TPGroup.of(None, sp, stats=stats)
        # this rank's tokens
        seq = (lambda a: a.tensor_split(tp.size, 1)[tp.rank]) if sp else (lambda a: a)
        fc, proj = ColumnParallelLinear(full.fc, tp), RowParallelLinear(full.proj, tp)
        xr = seq(x).clone().requires_grad_()
        y = proj(F.gelu(fc(xr), approximate="tanh"))
        fwd = comm.CommStats(Counter(stats.bytes_sent), Counter(stats.calls))
        y.backward(seq(dy))
        bwd = comm.CommStats(stats.bytes_sent - fwd.bytes_sent, stats.calls - fwd.calls)
        if not sp:
            _in_turn(f"Z_r[0, 0, :4] = {[round(v, 4) for v in partial[0, 0, :4].tolist()]}   after "
                     "g, + bias: "
                     f"{[round(v, 4) for v in y[0, 0, :4].tolist()]}")
        out[sp] = dict(out=y.detach(), grad=xr.grad, ref=seq(ref.detach()), ref_grad=seq(xf.grad),
                       forward=dict(fwd.calls), backward=dict(bwd.calls),
                       forward_bytes=dict(fwd.bytes_sent),
                       backward_bytes=dict(bwd.bytes_sent))
    return out


# ----------------------------------------------------------------------------- lesson 05


def pipeline_runs(cfg, runs: list, steps: int = 1) -> list:
    """Train `cfg` under each (ParallelConfig, global_batch) of `runs` (all of this world's pp) in
    this one job (`train_layouts`, as `zero_memory`). Returns, per run, this rank's RankResult:
    .memory["activations"] the peak bytes saved for backward, .spans the last step's [(Action,
    start, end)] in perf_counter seconds, .losses the global loss of each step.
    """
    return train_layouts([dict(par=par, global_batch=b) for par, b in runs], cfg=cfg, steps=steps)
