"""Context and expert parallelism against one device: attention over a long sequence split over
the ranks, and a mixture-of-experts layer with its experts split, fp32, gloo.

One launch per world size n runs every variant side by side in the same n worker processes:

  attention     causal attention of B sequences of T tokens, forward and backward, as a training
                step runs it: "one device" (F.scaled_dot_product_attention on all T tokens,
                what each rank would do alone), and context_parallel.attention over the n ranks
                by "ring", "all-gather" and "ulysses" (each rank holds T / n tokens, balanced;
                the ring's blocks run minipar's own online-softmax code, not a fused kernel)
  moe           a MoE layer (n_expert experts, top k, dropless) on each rank's own tokens,
                forward and backward: "one device" (moe.MoE, every expert here) and "expert
                parallel"
                (expert_parallel.ExpertParallel: n_expert / n experts here, the tokens sent to the
                ranks that hold theirs by all-to-all and back)

A first, untimed pass checks that each variant computes the same function: its outputs and input
gradients against one device's on the same tokens (relative norm), and the bytes each rank
sends against the modules' formulas (context_parallel.sent; for EP, 2 (a + b) h e of the rows
that leave and arrive). Then, after warm-up, a repetition runs each variant once from a barrier,
starting with a different variant each time; its time is the slowest rank's. "/ one device" is the
median over repetitions of variant / one device, "per launch" its range launch by launch.

PyTorch's own context parallel (torch.distributed.tensor.experimental.context_parallel) is the peer
on GPUs; on this CPU it does not run (tests/test_context_parallel.py asserts why: no sharding rule
for the CPU flash kernel, and the math kernel mixes tensors and DTensors). PyTorch has no expert
parallelism of its own: the peer is the one-device layer.
"""
from __future__ import annotations

import statistics
import sys
import time

import common  # bench/ is on sys.path
import torch
import torch.distributed as dist
from common import RESULTS, add_timing_arguments, main

import minipar
from minipar import comm
from minipar import context_parallel as cpm
from minipar.expert_parallel import ExpertParallel
from minipar.lessons.demos import slowest_rank
from minipar.lessons.demos_cp import attend
from minipar.moe import MoE

DEFAULTS = dict(worlds=(2,), tokens=2048, heads=8, head_dim=64, batch=1, moe_tokens=2048,
                d_model=256, ffn=1024, n_expert=8, top_k=2, reps=10, warmup=2, launches=2,
                threads=1)
CP = ("one device", "ring", "all-gather", "ulysses")
EP = ("one device", "expert parallel")


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULTS["worlds"]),
                        help="ranks n (CP and EP degree)")
    parser.add_argument("--tokens", type=int, default=DEFAULTS["tokens"],
                        help="attention: tokens T of a sequence")
    parser.add_argument("--heads", type=int, default=DEFAULTS["heads"], help="attention heads")
    parser.add_argument("--moe-tokens", dest="moe_tokens", type=int,
                        default=DEFAULTS["moe_tokens"], help="MoE: tokens on each rank")
    parser.add_argument("--n-expert", dest="n_expert", type=int, default=DEFAULTS["n_expert"])
    add_timing_arguments(parser, DEFAULTS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _moe_variants(s: dict, stats):
    torch.manual_seed(0)
    full = MoE(s["d_model"], s["ffn"], s["n_expert"], s["top_k"])
    torch.manual_seed(0)
    return {"one device": full, "expert parallel": ExpertParallel(
        MoE(s["d_model"], s["ffn"], s["n_expert"], s["top_k"]), None, stats)}


def _check(s: dict, q, k, v, x) -> dict:
    """The untimed pass: each variant's difference from one device, and its bytes against the
    formula."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    up = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))   # the same on every rank
    ref, ref_in = attend("one device", q, k, v)
    (ref * up).sum().backward()
    for method in CP[1:]:
        stats = comm.CommStats()
        got, mine = attend(method, q, k, v, stats)
        (got * cpm.shard(up, n, rank, dim=2)).sum().backward()
        want = cpm.shard(ref.detach(), n, rank, dim=2)
        grads = max(_rel(a.grad, cpm.shard(b.grad, n, rank, dim=2)) for a, b in zip(mine, ref_in))
        formula = cpm.sent(method, s["tokens"], n, rank, s["batch"], s["heads"], s["heads"],
                           s["head_dim"], 4)
        out[method] = dict(diff=max(_rel(got, want), grads), sent=sum(stats.bytes_sent.values()),
                           formula=sum(formula.values()))
    stats = comm.CommStats()
    layers = _moe_variants(s, stats)
    x = x.detach().requires_grad_()   # (so that the dispatch's backward sends too)
    y_ref, _ = layers["one device"](x)
    y_ep, routing = layers["expert parallel"](x)
    y_ep.sum().backward()   # the exchanges reversed
    to = torch.bincount(routing.experts[routing.kept] // (s["n_expert"] // n), minlength=n)
    away = int(to.sum() - to[rank])
    arriving = torch.tensor([int(t) for t in to])
    dist.all_reduce(arriving)   # what every rank sends to each: the column here is what arrives
    # a: my slots bound for other ranks; b: other ranks' slots bound for me; there and back, twice
    rows = 2 * (away + int(arriving[rank]) - int(to[rank])) * s["d_model"] * 4
    out["expert parallel"] = dict(diff=_rel(y_ep, y_ref), sent=stats.bytes_sent["ep_dispatch"] +
                                  stats.bytes_sent["ep_combine"], formula=rows)
    return out


def worker(s: dict) -> dict:
    """On every rank: {"attention"/"moe": {variant: [seconds of each timed pass]}, "check": ...}."""
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    torch.manual_seed(1)
    shape = (s["batch"], s["heads"], s["tokens"], s["head_dim"])
    q, k, v = (torch.randn(shape) for _ in range(3))
    torch.manual_seed(2 + dist.get_rank())
    x = torch.randn(s["moe_tokens"], s["d_model"])
    checked = _check(s, q, k, v, x)
    layers, times = _moe_variants(s, None), {"attention": {m: [] for m in CP},
                                             "moe": {m: [] for m in EP}}
    for rep in range(s["warmup"] + s["reps"]):
        for i in range(len(CP)):
            method = CP[(rep + i) % len(CP)]
            dist.barrier()
            start = time.perf_counter()
            out, _ = attend(method, q, k, v)
            out.sum().backward()
            if rep >= s["warmup"]:
                times["attention"][method].append(time.perf_counter() - start)
        for i in range(len(EP)):
            name = EP[(rep + i) % len(EP)]
            dist.barrier()
            start = time.perf_counter()
            y, _ = layers[name](x.requires_grad_())
            y.sum().backward()
            if rep >= s["warmup"]:
                times["moe"][name].append(time.perf_counter() - start)
    return {**times, "check": checked}


def _ratios(launches: list[list[dict]], part: str, variant: str) -> tuple[float, float, float]:
    """(median of variant / one device over all repetitions, lowest and highest launch median)."""
    per = [[a / b for a, b in zip(slowest_rank(ranks, part)[variant],
                                  slowest_rank(ranks, part)["one device"])] for ranks in launches]
    medians = [statistics.median(r) for r in per]
    return statistics.median(x for r in per for x in r), min(medians), max(medians)


def run(args, out_dir=RESULTS) -> str:
    s = common.settings(DEFAULTS, args)
    out_dir, since = common.start(out_dir)
    rounds = common.launch_rounds(s["worlds"], s["launches"], lambda world, i: minipar.launch(
        worker, world, s, timeout=600))
    lines = ["# context and expert parallelism against one device (gloo), fp32", "",
             __doc__.split("\n\n")[0], ""]
    for world, launches in rounds.items():
        lines += [f"## {world} ranks", "",
                  "| part | variant | ms (median) | / one device | per launch | sent KiB | formula "
                  "KiB | differs from one device |", "|---|---|---:|---:|---|---:|---:|---:|"]
        for part, variants in (("attention", CP), ("moe", EP)):
            for variant in variants:
                ms = 1e3 * statistics.median(slowest_rank(launches[0], part)[variant])
                if variant == "one device":
                    lines.append(f"| {part} | {variant} | {ms:.1f} | 1 | | | | |")
                    continue
                ratio, lo, hi = _ratios(launches, part, variant)
                check = launches[0][0]["check"][variant]
                lines.append(f"| {part} | {variant} | {ms:.1f} | {ratio:.2f} | {lo:.2f}-{hi:.2f} "
                             f"| {check['sent'] / 1024:.0f} | {check['formula'] / 1024:.0f} | "
                             f"{check['diff']:.1e} |")
        lines.append("")
    command = "python bench/run.py cp_ep " + " ".join(sys.argv[2:])
    text = "\n".join(lines) + "\n" + common.footer(s["threads"], since, command)
    (out_dir / "cp_ep.md").write_text(text)
    return text


if __name__ == "__main__":
    main(sys.modules[__name__])
