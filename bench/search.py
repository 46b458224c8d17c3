"""The planner's search on a 1,024-chip cluster of three kinds: its space, its time and its winner.

    python bench/run.py search                     # llama3-70b, global batch 1024: plan's space
    python bench/run.py search --micro-batches 1   # the space with micro-batch 1 only

The cluster: 48 DGX H100 boards, 40 MI300X boards and 40 Gaudi 3 boards (384 + 320 + 320 = 1,024
chips), joined by their NICs (Cluster.mixed). The space `plan` searches, and its size printed:
  layouts   every dp x tp x pp of 1,024 with tp inside the islands' common tile (8), pp at most
            the layers, a micro-batch size dividing the batch, each schedule (interleaved with
            v = 2, 4), ZeRO 0-3 where it applies (search.candidates);
  orders    each layout with a pipeline on every order of the three kinds (3! = 6: which kind runs
            which stages, search.placements), without one once;
  splits    each placed layout's layers per chunk by min-max dynamic programming and its micro-
            batches per replica by speed (predict.split_layout), recomputation none, selective,
            full, the first that fits;
  regrouped the REFINED fastest layouts that differ in more than tp, pp and the order, with each
            kind's stages at a TP degree of its own, in every order (search.regrouped: up to
            3! x 4^3 each), those that cannot beat the fastest skipped by a bound;
  refined   the REFINED fastest then searched one layer or share at a time (predict.refine).
Times are wall-clock seconds of one search after a warm-up search of a small cluster (imports and
first calls), every one in a fresh process (the planner's caches cold); the median of --repeats.
"""
from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from minipar.model import GPTConfig
from minipar.planner import candidates, explain, plan
from minipar.planner.cluster import Cluster
from minipar.planner.search import REFINED, placements


def cluster() -> Cluster:
    return Cluster.mixed([Cluster.preset("dgx-h100", nodes=48), Cluster.preset("mi300x", nodes=40),
                          Cluster.preset("gaudi3", nodes=40)])


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="llama3-70b", help="a GPTConfig preset")
    parser.add_argument("--batch", type=int, default=1024, help="global batch, sequences")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="micro-batch sizes searched (plan's default, 1 2 4 8)")
    parser.add_argument("--repeats", type=int, default=1, help="searches timed")


def _search(cfg, mixed, batch: int, mbs: tuple, only_time: bool = False):
    """(seconds, the ranked plan) of one search, after a warm-up search of a small cluster
    (imports and first calls); in a fresh process, or this one's first, every cache is cold."""
    plan(GPTConfig.preset("tiny"), Cluster.mixed([Cluster.preset("dgx-h100"),
                                                  Cluster.preset("mi300x")]), 16)
    start = time.perf_counter()
    ranked = plan(cfg, mixed, batch, micro_batches=mbs)
    seconds = time.perf_counter() - start
    return seconds if only_time else (seconds, ranked)


def run(args, out_dir) -> str:
    cfg, mixed, mbs = GPTConfig.preset(args.model), cluster(), tuple(args.micro_batches)
    layouts = list(candidates(cfg, mixed, args.batch, mbs))
    orders = len(placements(mixed))
    placed = sum(orders if par.pp > 1 else 1 for par, _ in layouts)
    times = []
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        for _ in range(args.repeats - 1):   # each in a fresh process: the planner's caches cold
            times.append(pool.submit(_search, cfg, mixed, args.batch, mbs, True).result())
    seconds, ranked = _search(cfg, mixed, args.batch, mbs)
    times.append(seconds)
    regrouped = sum(1 for e in ranked if e.par.stage_tp)
    rows = [("cluster", f"{mixed.name}: {mixed.world} chips"),
            ("model, global batch", f"{args.model}, {args.batch}; micro-batches {list(mbs)}"),
            ("layouts (dp x tp x pp, schedule, v, ZeRO, micro-batch)", f"{len(layouts):,}"),
            ("orders of the kinds per pipelined layout", f"{orders}"),
            ("placed layouts split and sized", f"{placed:,} (x up to 3 recomputations)"),
            ("fitting, timed and ranked", f"{len(ranked):,}, {regrouped} of them regrouped; the "
                                          f"{REFINED} fastest refined"),
            ("search time, s", f"{statistics.median(times):.1f}" +
             (f" (median of {len(times)}: {min(times):.1f}-{max(times):.1f})" if len(times) > 1
              else "")),
            ("winner", f"{ranked[0].label}, {ranked[0].step_time:.3f} s a step")]
    table = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    text = f"{table}\n\n```\n{explain(ranked, 3)}\n```"
    (out_dir / "search.md").write_text(text + "\n")
    return text
