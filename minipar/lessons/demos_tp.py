"""Worker functions for lesson 04 (tensor parallelism), run on every rank by `minipar.launch`
(a launched function must live in a module: the processes `launch` starts import it by name).

    tp_block_timing(cfg, widths)   one tensor-parallel transformer block's forward and backward,
                                   its f/g collectives timed apart from the rest (the matmuls)
    all_reduce_timing(sizes)       minipar's ring all-reduce alone, at each size: the points the
                                   lesson fits its latency-bandwidth model to
    block_and_ring(cfg, widths, sizes)  both in one launch (a launch costs seconds here)
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minipar import comm
from minipar.lessons.demos import rank_device, sync_device
from minipar.model import Block, GPTConfig
from minipar.tensor_parallel import ParallelAttention, ParallelMLP, TPGroup


@dataclass(frozen=True)
class TimedTPGroup(TPGroup):
    """A TPGroup whose collectives (f's and g's, as tensor_parallel.py calls them) are each timed:
    perf_counter around the call, after waiting for queued GPU work, the seconds appended to
    `spans`. Everything else is TPGroup's."""
    spans: list = field(default_factory=list, compare=False, repr=False)

    @property
    def ops(self) -> comm.Collectives:
        inner = super().ops

        def timed(fn):
            def call(*args, **kwargs):
                sync_device()
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                sync_device()
                self.spans.append(time.perf_counter() - start)
                return out
            return call
        return comm.Collectives(*(timed(fn) for fn in
                                  (inner.all_reduce, inner.reduce_scatter, inner.all_gather)))


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, median, q3


def tp_block_timing(cfg="tiny", widths=(None,), batch: int = 4, reps: int = 20, warmup: int = 3,
                    seed: int = 0) -> list[dict]:
    """For each width h of `widths` (None: cfg's d_model), one transformer block of cfg at that
    width, attention and MLP tensor-parallel over this world (no SP), runs forward and backward
    on a (batch, s, h) input `warmup` times untimed, then `reps` times timed, a barrier before
    each. Per repetition: "step" the whole forward + backward, "comm" the sum of its collectives
    (f's two all-reduces in backward, g's two in forward), "compute" the difference (matmuls,
    attention, GeLU, LayerNorms). Returns per width {"h", "step", "comm", "compute": [seconds per
    repetition], "quartiles": {those three: (q1, median, q3)}, "bytes", "calls": {collective: one
    repetition's}, "same_bytes": whether every repetition sent those bytes}."""
    torch.set_num_threads(1)
    cfg = GPTConfig.preset(cfg) if isinstance(cfg, str) else cfg
    device, out = rank_device(), []
    for h in widths:
        c = cfg if h is None else cfg.replace(d_model=h)
        torch.manual_seed(seed)
        stats = comm.CommStats()
        tp = TimedTPGroup.of(None, stats=stats)
        block = Block(c)
        block.attn, block.mlp = ParallelAttention(block.attn, tp), ParallelMLP(block.mlp, tp)
        block.to(device)
        x = torch.randn(batch, c.seq_len, c.d_model, device=device, requires_grad=True)
        dy = torch.randn_like(x)
        times = {"step": [], "comm": [], "compute": []}
        sent = []
        for i in range(warmup + reps):
            for p in (*block.parameters(), x):
                p.grad = None
            stats.bytes_sent.clear(), stats.calls.clear(), tp.spans.clear()
            dist.barrier()
            sync_device()
            start = time.perf_counter()
            block(x).backward(dy)
            sync_device()
            step = time.perf_counter() - start
            if i >= warmup:
                times["step"].append(step)
                times["comm"].append(sum(tp.spans))
                times["compute"].append(step - sum(tp.spans))
                sent.append(dict(stats.bytes_sent))
        quartiles = {k: _quartiles(v) for k, v in times.items()}
        out.append(dict(h=c.d_model, **times, quartiles=quartiles, bytes=sent[0],
                        calls=dict(stats.calls), same_bytes=all(s == sent[0] for s in sent)))
    return out


def all_reduce_timing(sizes, reps: int = 10, warmup: int = 2) -> dict[int, list[float]]:
    """{bytes: seconds of each of `reps` calls} of `comm.all_reduce` (the ring a TPGroup's f and g
    run) on an fp32 tensor of each size in `sizes` (bytes), over this world, after `warmup` untimed
    calls, a barrier before each: the same clock as TimedTPGroup's."""
    out = {}
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=rank_device())
        times = []
        for i in range(warmup + reps):
            dist.barrier()
            sync_device()
            start = time.perf_counter()
            comm.all_reduce(x)
            sync_device()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        out[nbytes] = times
    return out


def block_and_ring(cfg="tiny", widths=(None,), sizes=(), batch: int = 4, reps: int = 20,
                   warmup: int = 3) -> dict:
    """`tp_block_timing` then `all_reduce_timing(sizes)`, in one launch: {"blocks": the first's
    list, "all_reduce": the second's dict}."""
    blocks = tp_block_timing(cfg, widths, batch, reps, warmup)
    return {"blocks": blocks, "all_reduce": all_reduce_timing(sizes, reps, warmup)}
