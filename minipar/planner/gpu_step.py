"""A layout's step on GPUs, from its Estimate's splits (`predict.split_layout`): each DP replica's
pipeline simulated with gpu_time's chunk costs and messages (`pipeline.replayed`), the slowest
replica's, plus the exposed DP/ZeRO time and the optimizer step of the busiest stage. The terms
of the breakdown (TERMS) sum to the step; predict.py's docstring says what each holds.
"""
from __future__ import annotations

import functools

from minipar import memory, pipeline
from minipar.mesh import layout_ranks
from minipar.planner.gpu_time import chunk_cost, dp_time, messages, optimizer_time, work_on

TERMS = ("compute", "recompute", "memory_bound", "tp_comm", "cp_comm", "ep_comm", "bubble",
         "pp_p2p", "dp_comm", "optimizer")


@functools.lru_cache(maxsize=4096)
def _simulate(name: str, p: int, m: int, v: int, F: tuple, B: tuple, W: tuple, latency: float):
    """(the Replay of a schedule with messages of `latency`, its makespan without them); costs are
    normalised by the caller so that layouts with the same proportions share one simulation
    (cached: the caller must not modify it)."""
    cost = {"F": list(F), "B": list(B), "W": list(W)}
    actions = pipeline.cached_schedule(name, p, m, v)
    return pipeline.replayed(actions, p, m, v, cost=cost, latency=latency, checked=True, free=True)


def _pipeline_time(par, costs: list[dict], m: int, latency: float):
    """(makespan with messages, makespan without, busiest rank, (the Timeline with messages, its
    time unit in seconds)) of one replica's pipeline."""
    per_op = {op: [sum(c[op].values()) for c in costs] for op in ("F", "B", "W")}
    u = max(per_op["F"]) or 1.0
    norm = {op: tuple(round(x / u, 9) for x in xs) for op, xs in per_op.items()}
    args = (par.schedule, par.pp, m, par.virtual_stages, norm["F"], norm["B"], norm["W"])
    with_msgs, free = _simulate(*args, round(latency / u, 9) if par.pp > 1 else 0.0)
    # each rank runs every micro-batch of its chunks: its busy time, without walking the replay
    busy = [sum(norm[op][c] for c in range(r, len(costs), par.pp) for op in norm)
            for r in range(par.pp)]
    busiest = max(range(par.pp), key=lambda r: busy[r])
    return u * with_msgs.makespan, u * free, busiest, (with_msgs, u)


def _replica_time(cfg, est, j: int) -> tuple:
    """(seconds of DP replica j's pipeline, its breakdown, each chunk's per-micro-batch costs, its
    Timeline and its time unit)."""
    par, cluster, b, m = est.par, est.cluster, est.micro_batch, est.shares[j]
    p, chunks = par.pp, len(est.layers)
    costs, link = [], cluster.link([layout_ranks(par, r, j)[0] for r in range(p)])
    stages = [work_on(cluster, layout_ranks(par, r, j), par.at_stage(r), b, est.attention,
                      est.float8)
              for r in range(p)]
    # stage_tp: a sender sends a copy to each of up to ceil(t_receiver / t_sender) ranks, one
    # after the other (timed at the most of any boundary, both ways; the last stage and the first
    # meet only with interleaved chunks); a receiver of fewer TP ranks waits for one
    bounds = [(r, r + 1) for r in range(p - 1)] + [(p - 1, 0)] * (par.virtual_stages > 1)
    fan = max(-(-par.tp_at(y) // par.tp_at(x)) for a, b in bounds for x, y in ((a, b), (b, a))) \
        if par.stage_tp else 1
    for c, n in enumerate(est.layers):
        w = stages[c % p]
        costs.append(chunk_cost(cfg, w, n, c == 0, c == chunks - 1))
        latency, own = (fan * x for x in messages(cfg, par.at_stage(c % p), w, link,
                                                  est.overlap)) if p > 1 else (0.0, 0.0)
        costs[c]["F"]["pp_p2p"] = own * (c > 0)            # with the chunk before
        costs[c]["B"]["pp_p2p"] = own * (c < chunks - 1)   # with the chunk after
    with_msgs, free, r, timeline = _pipeline_time(par, costs, m, latency)
    mine = [costs[c] for c in range(r, chunks, p)]
    terms = {k: m * sum(c[op].get(k, 0.0) for c in mine for op in c) for k in TERMS}
    terms.update(bubble=max(0.0, free - sum(terms.values())),
                 pp_p2p=terms["pp_p2p"] + max(0.0, with_msgs - free))
    return with_msgs, terms, costs, timeline


def gpu_step(cfg, est) -> tuple[float, dict, tuple]:
    """(seconds, breakdown by TERMS, (the slowest replica's Timeline, its time unit)) of `est`."""
    par, cluster, p = est.par, est.cluster, est.par.pp
    per = memory.layout_bytes(par.precision, par.reduce_fp32)
    replicas = {}
    for j, m in enumerate(est.shares):  # identical replicas (same share, same GPUs) are timed once
        key = (m, cluster.tp_parts(par.dp, par.tp, p, par.stage_tp)[j])
        if key not in replicas:
            replicas[key] = _replica_time(cfg, est, j)
    span, terms, costs, timeline = max(replicas.values(), key=lambda x: x[0])
    chunks, dp, opt = len(est.layers), 0.0, 0.0
    for r in range(p):
        t, mine = par.tp_at(r), range(r, chunks, p)
        # ZeRO-3's units (with expert parallelism, where ZeRO is not, the parameters: its experts)
        units = memory.rank_units(cfg, t, list(est.layers), p, r, of=functools.partial(
            memory.chunk_params, ep=par.ep) if par.ep > 1 else None)
        backward = sum(v for c in mine for op in ("B", "W") for k, v in costs[c][op].items()
                       if k != "pp_p2p")  # what gradient buckets hide under
        forward = sum(costs[c]["F"].get("compute", 0.0) for c in mine)
        stage = layout_ranks(par, pp_rank=r)
        link = cluster.link(stage[::t])
        # expert parallelism: the experts' own DP group, every ep-th of the stage's DP ranks
        experts = (sum(memory.expert_params(cfg, par.ep)) * sum(est.layers[r::p]),
                   cluster.link(stage[::t * par.ep])) if par.ep > 1 else (0, None)
        dp = max(dp, dp_time(par.at_stage(r), sum(units), per, link, backward, backward + forward,
                             len(units), forward, est.overlap, experts))
        hbm = min(g.memory_bandwidth for g in cluster.parts_of(stage))
        opt = max(opt, optimizer_time(sum(units) / (par.dp * par.cp if par.zero else 1), per,
                                      hbm))
    return span + dp + opt, {**terms, "dp_comm": dp, "optimizer": opt}, timeline
