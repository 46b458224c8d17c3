"""minipar's ZeRO and mixed-precision DP against PyTorch's: ZeRO-3 vs FSDP2, ZeRO-2 vs FSDP2
with reshard_after_forward=False, ZeRO-1 vs DDP + ZeroRedundancyOptimizer, bf16 DP vs DDP under
autocast, bf16 ZeRO-2 vs FSDP2 with a bf16 MixedPrecisionPolicy; gloo.

Sets of variants (--sets), each with its peer; every variant trains the same model (same seed) on
the same fixed batch, in the same worker processes. minipar's are built through the public API,
minipar.parallelize with ParallelConfig(dp=N, ...); PyTorch's are as a user would write them.

  zero3        zero3/minipar, zero3/torch   zero=3 (its own ring / the backend's collectives)
               fsdp2 (peer)                 fully_shard on each block, then the root (ZeRO-3)
  zero2        zero2/bucketed               zero=2, dp_mode="bucketed": each bucket reduce-
                                            scattered on the communication thread as soon as
                                            complete, its full buffer freed once reduced
               zero2/naive                  zero=2, dp_mode="naive": one flat buffer reduce-
                                            scattered after backward (the simple version: its
                                            peak is ZeRO-1's)
               fsdp2-noreshard (peer)       fully_shard(..., reshard_after_forward=False): ZeRO-2
  zero1        zero1/bucketed, zero1/naive  zero=1, the same two gradient paths
               ddp+zero-r (peer)            DDP + torch.distributed.optim.ZeroRedundancyOptimizer
                                            around AdamW: PyTorch's ZeRO-1
  bf16         dp-bf16/minipar              precision="bf16", dp_mode="bucketed": bf16 weights,
                                            fp32 masters, fp32 gradient buckets all-reduced
               ddp-bf16 (peer)              DDP on the fp32 model, forward under
                                            torch.autocast("cpu", bfloat16): fp32 gradients
  zero2-bf16   zero2-bf16/minipar           zero=2, precision="bf16": fp32 master shards and
                                            gradient shards, bf16 weights
               fsdp2-bf16 (peer)            fsdp2-noreshard with MixedPrecisionPolicy(param_dtype=
                                            bfloat16, reduce_dtype=float32)
  floors       local, local-bf16            no communication at all (each rank alone; bf16:
                                            autocast): no variant can be faster but by noise

All use AdamW(lr 1e-3, betas 0.9/0.95, weight decay 0.1 on matrices only). Bucketed variants use
--bucket-mb buckets, and so does DDP (bucket_cap_mb). The bf16 sets run --bf16-batch sequences per
rank: a CPU without bf16 units (AVX2 only) runs bf16 matmuls some 5-10x slower than fp32 ones.

Step time: a repetition runs one step of each variant (forward, backward, gradient sync, optimizer
step, zero_grad) from a barrier, starting with a different variant each time, after warm-up steps;
its time is the slowest rank's. Times are medians over every repetition of every launch, with the
interquartile range; the ratio is the median of variant/peer over repetitions run back to back,
"per launch" its range launch by launch. "in step()": the median time (all ranks) from the end of
backward to the end of zero_grad: ZeRO-1/2's wait for their last buckets, all-gather and update,
ZeRO-R's broadcasts, minipar DP's wait for its last bucket; DDP and FSDP2 wait for their
gradients inside backward, so a rank's wait for a slower rank lands in backward for them and in
step() for minipar.

Memory (first launch only, before the timed steps, one variant at a time): every variant is
measured by the same tool, minipar.tracker.Tracker, a dispatch mode that follows every tensor
storage an op creates until it dies. The model, the wrapper and the optimizer are built inside the
tracker (so persistent buffers such as DDP's buckets and minipar's gradient buckets and ring
receive space are seen from birth); two steps run (optimizer state made, DDP's buckets rebuilt),
then a third is measured. "peak" is the largest total of live storages during that step, "after
forward" the total just before backward, "between steps" what is still held after zero_grad.
"full params after forward": the bytes of the storages that the parameters of each module had
while it ran forward that are still alive when forward ends (weak references taken by forward
pre-hooks): gathered parameters not yet freed, and anything not sharded. The tracker leaves an op
on DTensors (FSDP2's sharded parameters, gradients and optimizer state) to DTensor and sees it run
on the local shards (a DTensor's own storage holds no data, yet reads the global size). PyTorch's
MemTracker (torch.distributed._tools.mem_tracker), which does the same,
measures every variant a second time at the first world size, as a check ("peak by MemTracker").
A dispatch mode sees the thread it was entered on: minipar's communication threads allocate
nothing (what they write is allocated on the main thread first), and PyTorch's peers run every
allocation on the main thread on CPU. Not counted, for any variant: gloo's internal buffers (not
tensors), Python objects, the allocator's slack. Memory columns are the fullest rank's.
Sanity: every variant's loss at every step (rank-local, same rows on a rank) is compared with the
peer's (relative difference): 0 at the first step in fp32, then reduction order only; bf16
variants hold 16-bit weights and minipar's DP differs from DDP's fp32 weights under autocast.
"""
from __future__ import annotations

import sys
import time
import warnings

import common  # bench/ is on sys.path
import torch
import torch.distributed as dist
from common import RESULTS, add_timing_arguments, main
from zero_variants import SETS, Run, batch_of, measure_memory, variants

import minipar
from minipar import data
from minipar.mesh import Mesh
from minipar.model import GPTConfig

DEFAULTS = dict(worlds=(2, 4), model="small-cpu", batch=4, bf16_batch=1, bucket_mb=2.0,
                sets=tuple(SETS), tools=("tracker", "memtracker"), reps=8, warmup=2, launches=2,
                threads=1)


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULTS["worlds"]),
                        help="world sizes")
    parser.add_argument("--model", default=DEFAULTS["model"], help="GPTConfig preset")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per rank")
    parser.add_argument("--bf16-batch", dest="bf16_batch", type=int,
                        default=DEFAULTS["bf16_batch"], help="sequences per rank, bf16 variants")
    parser.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=DEFAULTS["bucket_mb"],
                        help="bucket size in MiB: minipar's bucketed variants and DDP's")
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=list(DEFAULTS["sets"]),
                        help="which comparisons to run")
    parser.add_argument("--tools", nargs="+", choices=["tracker", "memtracker"],
                        default=list(DEFAULTS["tools"]),
                        help="memory trackers (the first gives the ratios; the others a column)")
    add_timing_arguments(parser, DEFAULTS)


# ----------------------------------------------------------------------------- inside a worker


def worker(model: str, batches: tuple, bucket_mb: float, sets, reps: int, warmup: int,
           threads: int, tools) -> dict:
    """On every rank: {"step", "opt": {variant: [seconds of each timed step, of its run.step()]},
    "losses": {variant: [loss of every step]}, "memory": {variant: {tool: measure_memory's}} (no
    tools: none)}. batches: sequences per rank, (fp32, bf16)."""
    # FSDP2 on our logits: no in-place
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    # MemTracker on None grads
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")
    if threads:
        torch.set_num_threads(threads)
    from torch.distributed.device_mesh import init_device_mesh

    cfg = GPTConfig.preset(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    device_mesh, mesh = init_device_mesh("cpu", (world,)), Mesh.build(dp=world)
    inputs = {}
    for batch in set(batches):
        xy = data.global_batch("synthetic", 0, batch * world, cfg.seq_len, cfg.vocab_size)
        inputs[batch] = [data.shard(t, rank, world) for t in xy]
    names = variants(sets)
    batch = {name: batch_of(name, *batches) for name in names}
    build = lambda name: Run(name, cfg, mesh, device_mesh, bucket_mb, batch[name])
    mem = {name: {tool: measure_memory(lambda: build(name), *inputs[batch[name]], tool)
                  for tool in tools} for name in names}
    runs = {name: build(name) for name in names}
    step, opt, losses = ({name: [] for name in names} for _ in range(3))
    for i in range(warmup + reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            run = runs[name]
            dist.barrier()
            start = time.perf_counter()
            loss = run.forward(*inputs[batch[name]])
            run.backward(loss)
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
    import zero_report as report

    s = common.settings(DEFAULTS, args, overrides)
    sets = tuple(s["sets"])
    out_dir, since = common.start(out_dir)

    def tools(world: int, i: int) -> tuple:  # memory at the first launch; the check at one world
        return tuple(s["tools"][:1 if world != s["worlds"][0] else None]) if i == 0 else ()

    def launch(world: int, i: int) -> list:  # one launch of `world` ranks
        return minipar.launch(worker, world, s["model"], (s["batch"], s["bf16_batch"]),
                              s["bucket_mb"], sets, s["reps"], s["warmup"], s["threads"],
                              tools(world, i), timeout=1800)

    launches = common.launch_rounds(s["worlds"], s["launches"], launch)
    rows = [row for world, runs in launches.items() for row in report.summarise(world, runs, sets)]
    cfg = GPTConfig.preset(s["model"])
    md, verdict = report.table(rows), report.verdicts(rows)
    terms = report.gradient_term(rows, cfg)
    command = (f"python bench/run.py zero --worlds {' '.join(map(str, s['worlds']))} "
               f"--model {s['model']} --batch {s['batch']} --bf16-batch {s['bf16_batch']} "
               f"--bucket-mb {s['bucket_mb']:g} --sets {' '.join(sets)} "
               f"--tools {' '.join(s['tools'])} --reps {s['reps']} --warmup {s['warmup']} "
               f"--launches {s['launches']} --threads {s['threads']}")
    setup = (f"Model `{s['model']}`: {cfg.num_params:,} parameters "
             f"({4 * cfg.num_params / 2**20:.1f} MiB in fp32, P below); {s['batch']} x "
             f"{cfg.seq_len} tokens per rank ({s['bf16_batch']} x {cfg.seq_len} in bf16); "
             f"buckets of {s['bucket_mb']:g} MiB (minipar's bucketed variants, DDP's "
             "bucket_cap_mb).")
    (out_dir / "zero.md").write_text(
        "# ZeRO and mixed-precision DP: minipar vs FSDP2, DDP and ZeroRedundancyOptimizer "
        f"(gloo)\n\n{__doc__.strip()}\n\n{setup}\n\n{md}\n\n{report.flags(rows)}"
        f"{verdict}\n\n{terms}\n\n{report.bucket_findings(rows, cfg, s['bucket_mb'])}"
        f"{report.findings(rows, cfg)}"
        f"![step time and memory](zero.png)\n\n{common.footer(s['threads'], since, command)}")
    report.plot(rows, s, out_dir / "zero.png")
    return f"{setup}\n\n{md}\n\n{report.flags(rows)}{verdict}\n\n{terms}"


if __name__ == "__main__":  # python bench/zero.py [options], the same as python
                            #   bench/run.py zero [options]
    main(sys.modules[__name__])
