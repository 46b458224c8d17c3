"""The search over layouts: every candidate that fits, ranked by predicted step time (`plan`), why
the winner wins (`explain`), and what would fit when nothing does (`NoFeasiblePlan`)."""
from __future__ import annotations

import dataclasses
import itertools
import math

from minipar.config import RECOMPUTE, SCHEDULES, ParallelConfig
from minipar.planner.cluster import Cluster, GiB, flops_unit, memory_unit
from minipar.planner.gpu_step import TERMS
from minipar.planner.partition import chunk_seconds, slowest_chunk
from minipar.planner.predict import (Estimate, _proportional, _share_unit, estimate, refine, sized,
                                     split_layout, time_layout)


class NoFeasiblePlan(ValueError):
    """No layout fits the cluster's memory; the message says what would."""


# Differences the ranking and the explanation call none: the cost model's float rounding ("saves
# 8.88e-16 s of bubble") is not a reason, and neither is a tenth of a percent of a step.
NEGLIGIBLE_TIME = 1e-3         # of the winner's step time
NEGLIGIBLE_MEMORY = 0.05 * GiB  # bytes a GPU
REFINED = 5  # on a mixed cluster, the layouts fastest under the proportional split whose splits
             #   plan then searches (each search times tens of splits)


def rank(estimates: list[Estimate]) -> list[Estimate]:
    """Fastest first. Layouts within NEGLIGIBLE_TIME of the fastest of a run of near-equal times
    are ties, not a ranking: among them less memory (to NEGLIGIBLE_MEMORY) goes first, then the
    simpler layout (fewer pipeline stages, chunks, TP ranks, ZeRO stage and micro-batches)."""
    by_time, ranked = sorted(estimates, key=lambda e: e.step_time), []
    simple = lambda e: (e.par.pp, e.par.virtual_stages, e.par.tp, e.par.zero,  # noqa: E731
                        e.par.microbatches, e.step_time)
    while by_time:
        tied = [e for e in by_time if e.step_time <= (1 + NEGLIGIBLE_TIME) * by_time[0].step_time]
        by_time = by_time[len(tied):]
        ranked += sorted(tied, key=lambda e: (round(e.peak_memory / NEGLIGIBLE_MEMORY), simple(e)))
    return ranked


def placements(cluster: Cluster) -> list[Cluster]:
    """The orders of a mixed cluster's parts that `plan` tries: ranks are numbered part after part
    and pipeline stages are the grid's outermost axis (mesh.py), so the order says which kind runs
    which stages (the first stage holds the most micro-batches' activations under 1F1B, the last
    the head). Every distinct order: k! for k parts (6 for three kinds); the cluster itself if
    homogeneous. Without a pipeline the order only renumbers DP replicas (plan tries it once)."""
    orders = dict.fromkeys(itertools.permutations(cluster.groups or (cluster,)))
    return [Cluster.mixed(order) for order in orders] if cluster.groups else [cluster]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, m: int, n_layer: int, schedules, virtual_stages):
    if pp == 1:  # no pipeline: micro-batches are gradient-accumulation steps
        yield "1f1b", 1
        return
    for name in schedules:
        if name != "interleaved-1f1b":
            yield name, 1
        elif m % pp == 0:
            yield from ((name, v) for v in virtual_stages if v > 1 and pp * v <= n_layer)


# context parallelism is searched for sequences this long or longer (Llama 3 used it for 128K)
LONG_SEQUENCE = 16384


def candidates(cfg, cluster: Cluster, global_batch: int, micro_batches=(1, 2, 4, 8),
               schedules=SCHEDULES,
               virtual_stages=(2, 4), zero=(0, 1, 2, 3), precision: str = "bf16"):
    """(ParallelConfig, micro_batch) of every layout `plan` considers, recompute left at "none": all
    of cluster.world, tp dividing gpus_per_node (TP groups, innermost in the grid, then never
    straddle two nodes: on a mixed cluster, two islands), ZeRO > 0 only with dp > 1, ZeRO-3 only
    without pp (it would gather every unit again for each micro-batch), sequence parallel whenever
    tp > 1 (it only saves) and ZeRO < 3; context parallelism 2, 4, 8 by each method for sequences
    of LONG_SEQUENCE tokens or more, expert parallelism over every divisor of dp that divides the
    experts; of those, the ones ParallelConfig.check accepts for `cfg` (the widths tp must divide,
    tied embeddings, what CP and EP combine with: its rules, said once there)."""
    world = cluster.world
    cps = [(1, "ring")] + [(c, m) for c in (2, 4, 8) for m in ("ring", "all-gather", "ulysses")
                           if cfg.seq_len >= LONG_SEQUENCE]
    for tp in (t for t in _divisors(world) if cluster.gpus_per_node % t == 0):
        for pp, (cp, method) in ((p, c) for p in _divisors(world // tp) if p <= cfg.n_layer
                                 for c in cps if (world // (tp * p)) % c[0] == 0):
            dp = world // (tp * pp * cp)
            for b in (b for b in micro_batches if global_batch % (dp * b) == 0):
                m = global_batch // (dp * b)
                for name, v in _schedules(pp, m, cfg.n_layer, schedules, virtual_stages):
                    for z, ep in ((z, e) for z in zero if (z == 0 or dp > 1) and not (
                            z == 3 and pp > 1) for e in _divisors(dp) if e == 1 or cfg.n_expert):
                        par = ParallelConfig(dp=dp, tp=tp, pp=pp, zero=z, microbatches=m,
                                             schedule=name, virtual_stages=v,
                                             sequence_parallel=tp > 1 and z != 3
                                             and cfg.seq_len % tp == 0 and not cfg.n_expert,
                                             precision=precision, cp=cp, cp_method=method, ep=ep)
                        try:
                            par.check(cfg, global_batch)
                        except ValueError:
                            continue
                        yield par, b


def plan(cfg, cluster: Cluster, global_batch: int, micro_batches=(1, 2, 4, 8), schedules=SCHEDULES,
         virtual_stages=(2, 4), zero=(0, 1, 2, 3), recompute=("none", "selective", "full"),
         precision: str = "bf16", attention: str = "flash",
         overlap: str = "minipar") -> list[Estimate]:
    """Every layout of `candidates` that fits memory_per_gpu, fastest first (`rank`). Each takes the
    first of `recompute` with which it fits (recomputing more only costs time). On a mixed cluster
    the REFINED fastest have their layer and batch splits searched (`predict.refine`). Raises
    NoFeasiblePlan, saying what would fit, when none does."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer (sequences a step), got "
                         f"{global_batch!r}")
    if not recompute or set(recompute) - set(RECOMPUTE):
        raise ValueError(f"recompute must be some of {RECOMPUTE}, got {recompute!r}")
    fitting, smallest, orders = [], None, placements(cluster)
    deepest = max(recompute, key=RECOMPUTE.index)   # the most recomputation allowed
    # a layout's orders one after the other (their schedule and splits are cached), ranked in the
    # order order after order (`rank` keeps it among equals)
    for j, (par, b) in enumerate(candidates(cfg, cluster, global_batch, micro_batches, schedules,
                                            virtual_stages, zero, precision)):
        for i, placed in enumerate(orders[:len(orders) if par.pp > 1 else 1]):
            split = lambda rc: split_layout(cfg, par.replace(recompute=rc), placed,  # noqa: E731
                                            global_batch, b, attention, overlap, exact=False)
            try:  # the most recomputation first: what does not fit with it fits with none
                most = split(deepest)
                for rc in recompute if most.fits else ():
                    est = most if rc == deepest else split(rc)
                    if est.fits:
                        fitting.append(((i, j), time_layout(cfg, est)))
                        break
            except ValueError:
                continue
            if not most.fits and (smallest is None or (most.peak_memory / most.capacity, i, j)
                                  < smallest[0]):
                smallest = ((most.peak_memory / most.capacity, i, j), most)
    fitting = [e for _, e in sorted(fitting, key=lambda x: x[0])]
    smallest = smallest and smallest[1]
    if not fitting:   # the smallest with its step's transients (the search skipped them)
        smallest = smallest and split_layout(cfg, smallest.par, smallest.cluster, global_batch,
                                             smallest.micro_batch, attention, overlap)
        raise NoFeasiblePlan(_advice(cfg, cluster, global_batch, smallest, micro_batches, zero,
                                     recompute, precision))
    ranked = rank(fitting)
    if cluster.groups:  # mixed: the fastest few regrouped by kind, then their splits searched
        again = {}
        for est in ranked:  # the fastest REFINED distinct layouts but for tp, pp and the order
            key = (est.par.replace(tp=1, pp=1, sequence_parallel=False), est.micro_batch)
            if len(again) == REFINED:
                break
            again.setdefault(key, est)
        again = {(e.par, e.micro_batch, e.cluster.name): e for est in again.values()
                 for e in regrouped(cfg, est, recompute, beat=ranked[0].step_time)}
        ranked = rank(ranked + list(again.values()))
        ranked = rank([refine(cfg, e) for e in ranked[:REFINED]] + ranked[REFINED:])
    return ranked


def regrouped(cfg, est: Estimate, recompute=("none", "selective", "full"),
              beat: float = math.inf) -> list[Estimate]:
    """`est`'s layout with each kind's stages at a TP degree of its own (ParallelConfig.stage_tp):
    in every order of the kinds (`placements`), for each kind k a degree t_k dividing its island,
    with dp * t_k dividing its n_k chips, so that it runs n_k / (dp t_k) stages of dp x t_k chips
    (a slower kind can take more chips a stage, or the same chips in fewer stages: less bubble);
    the same dp, micro-batch, schedule and ZeRO, no sequence parallelism (stage_tp has none).
    Every such choice whose degrees differ, at most kinds! 4^kinds for 8-chip islands, timed (its
    splits as `split_layout` makes them) with the first of `recompute` from est's with which it
    fits; but not those whose busiest chunk alone (`_lower_bound`) takes `beat` seconds or more.
    `plan` regroups its REFINED fastest layouts that differ in more than tp, pp and the order,
    to beat its fastest."""
    par, out = est.par, []
    for cluster, choice in ((c, choice) for c in placements(est.cluster) for choice in
                            itertools.product(*([(t, part.world // (par.dp * t))
                                                 for t in _divisors(part.gpus_per_node)
                                                 if part.world % (par.dp * t) == 0]
                                                for part in c.groups))):
        stage_tp = tuple(t for t, stages in choice for _ in range(stages))
        if len(set(stage_tp)) == 1 or len(stage_tp) * par.virtual_stages > cfg.n_layer:
            continue
        for rc in recompute[recompute.index(par.recompute):]:   # each slower than the one before
            try:
                new = par.replace(pp=len(stage_tp), tp=max(stage_tp), stage_tp=stage_tp,
                                  sequence_parallel=False, recompute=rc, stage_layers=None,
                                  dp_shares=None)
                if _lower_bound(cfg, new, cluster, est.micro_batch, est.attention) >= beat:
                    break
                e = split_layout(cfg, new, cluster, est.global_batch, est.micro_batch,
                                 est.attention, est.overlap, exact=False)
            except ValueError:  # the schedule's or the widths' rules
                break
            if e.fits:
                out.append(time_layout(cfg, e))
                break
    return out


def _lower_bound(cfg, par, cluster, b: int, attention: str) -> float:
    """Seconds a step of `par` takes at least, its replicas alike (each stage on one kind): the
    micro-batches through its busiest chunk, the layers split so that it is as short as can be
    (min_max's optimum), nothing else counted (a part in 10^9 under, for the float sums)."""
    return par.microbatches * (1 - 1e-9) * slowest_chunk(
        cfg.n_layer, *chunk_seconds(cfg, par, cluster, b, attention, dp_rank=0))


def _fits_somewhere(cfg, cluster, global_batch, precision) -> Estimate | None:
    for par, b in candidates(cfg, cluster, global_batch, (1,), precision=precision):
        try:
            est = split_layout(cfg, par.replace(recompute="full"), cluster, global_batch, b)
        except ValueError:
            continue
        if est.fits:
            return est
    return None


def _advice(cfg, cluster, global_batch, smallest, micro_batches, zero, recompute, precision) -> str:
    if smallest is None:
        return (f"no layout of {cluster.world} GPUs divides global_batch {global_batch} with "
                "micro-batches "
                f"{tuple(micro_batches)}: choose a global batch divisible by more data-parallel "
                "degrees")
    gpus = "; ".join(f"{g.name}: {g.memory_per_gpu / GiB:.0f} GiB a GPU, {g.usable:.0%} usable"
                     for g in cluster.groups or (cluster,))
    lines = [f"nothing fits ({gpus}) on {cluster.world} GPUs: the smallest, {smallest.label}, "
             f"needs {smallest.peak_memory / GiB:.1f} GiB on its fullest GPU, of "
             f"{smallest.capacity / GiB:.1f} usable there "
             f"({', '.join(f'{k} {v / GiB:.1f}' for k, v in smallest.memory.items())})."]
    if 1 not in micro_batches:
        lines.append("Try micro-batch 1 (activations scale with it).")
    if "full" not in recompute:
        lines.append("Allow recompute='full' (keeps only each layer's input).")
    if 3 not in zero or 2 not in zero:
        lines.append("Allow ZeRO-2/3 (shards gradients and parameters over dp).")
    for k in (2, 4, 8, 16, 32, 64):
        bigger = dataclasses.replace(cluster, nodes=cluster.nodes * k, groups=())
        est = _fits_somewhere(cfg, bigger, global_batch, precision)
        if est is not None:
            like = (f" of {bigger.memory_per_gpu / GiB:.0f} GiB, the smallest kind's," if
                    cluster.groups else f" ({bigger.nodes} nodes)")
            lines.append(f"With {bigger.world} GPUs{like} it fits, e.g. {est.label} "
                         f"({est.peak_memory / GiB:.1f} GiB).")
            break
    else:
        lines.append(f"Even {cluster.world * 64} GPUs are not enough at global batch "
                     f"{global_batch}.")
    return " ".join(lines)


def explain(estimates: list[Estimate], top: int = 5) -> str:
    """Why the winner wins: for each runner-up, the breakdown term that
    costs it most against the winner."""
    _check_top(top)
    if not estimates:
        return "no estimates"
    best = estimates[0]
    tiny = NEGLIGIBLE_TIME * best.step_time
    lines = [f"#1 {best.label}: {best.step_time:.4g} s ({best.mfu:.1%} MFU)"] + _blind(best)
    for i, e in enumerate(estimates[1:top], 2):
        if e.step_time - best.step_time <= tiny:
            lines.append(f"#{i} {e.label}: as fast, {_memory_against(e, best)}")
            continue
        diff = {k: e.breakdown[k] - best.breakdown[k] for k in TERMS}
        worst, gain = max(diff, key=diff.get), min(diff, key=diff.get)
        line = (f"#{i} {e.label}: +{e.step_time - best.step_time:.3g} s "
                f"({e.step_time / best.step_time - 1:+.1%}), mostly {worst} (+{diff[worst]:.3g} s)")
        if -diff[gain] > tiny:
            line += f", though it saves {-diff[gain]:.3g} s of {gain}"
        lines.append(line)
    return "\n".join(lines)


def vendor_blind(est: Estimate, cluster: Cluster | None = None) -> Estimate:
    """`est`'s layout split as if every chip were alike, on `cluster` in its own order of kinds
    (est's own by default): the layers and the micro-batches split evenly, timed when it fits."""
    cluster = cluster or est.cluster
    blind = sized(est.cfg, est.par, cluster, est.global_batch, est.micro_batch,
                  _proportional(est.cfg.n_layer, [1.0] * len(est.layers)),
                  _proportional(sum(est.shares), [1.0] * len(est.shares), _share_unit(est.par)),
                  est.attention, est.overlap)
    return time_layout(est.cfg, blind) if blind.fits else blind


def _blind(best: Estimate) -> list[str]:
    """On a mixed cluster, the winner against itself split as if every chip were alike: the same
    layout and order, the layers and the micro-batches split evenly."""
    if not best.cluster.groups:
        return []
    blind = vendor_blind(best)
    verdict = (f"{blind.step_time:.4g} s, {blind.step_time / best.step_time - 1:.1%} slower"
               if blind.fits else
               f"does not fit ({blind.peak_memory / GiB:.1f} GiB of {blind.capacity / GiB:.1f})")
    p = best.par.pp
    where = (f"stages in the order {best.cluster.name}, layers per chunk {list(best.layers)} "
             f"(chunk k on stage k % {p}), " if p > 1 else "") + \
        f"micro-batches per replica {list(best.shares)}"
    return [f"   split by speed: {where}; split evenly, as if all chips were alike: {verdict}"]


def _memory_against(e: Estimate, best: Estimate) -> str:
    more = e.peak_memory - best.peak_memory
    if abs(more) < NEGLIGIBLE_MEMORY:
        return "with the same memory"
    return f"with {abs(more) / GiB:.1f} GiB {'more' if more > 0 else 'less'}"


def _check_top(top) -> None:
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive integer (the rows to show), got {top!r}")


def format_table(estimates: list[Estimate], top: int = 10) -> str:
    """The ranked estimates as a text table: layout, step time, TFLOP/s,
    MFU, memory, and the breakdown (s)."""
    _check_top(top)
    shown = estimates[:top]
    (flops, fname), (mem, mname) = (flops_unit(*(e.flops_per_gpu for e in shown)),
                                    memory_unit(*(e.peak_memory for e in shown)))
    # every term, but context and expert parallelism's only where a layout has them
    terms = [k for k in TERMS if k not in ("cp_comm", "ep_comm") or any(e.breakdown[k]
                                                                         for e in shown)]
    heads = ["#", "layout", "step s", fname, "MFU", mname] + [f"{k} s" for k in terms]
    term = lambda e, k: f"{e.breakdown[k]:.3g}" if e.breakdown[k] > NEGLIGIBLE_TIME * 1e-6 * \
        e.step_time else "0"  # float noise of a simulated bubble is no bubble
    rows = [[str(i), e.label, f"{e.step_time:.4g}", f"{e.flops_per_gpu / flops:.3g}",
             f"{e.mfu:.1%}", f"{e.peak_memory / mem:.1f}"] + [term(e, k) for k in terms]
            for i, e in enumerate(shown, 1)]
    widths = [max(len(r[c]) for r in [heads] + rows) for c in range(len(heads))]
    fmt = lambda r: "  ".join(x.ljust(w) if c == 1 else x.rjust(w) for c,
                              (x, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(heads)] + [fmt(r) for r in rows])


def sweep(cfg, par, cluster, global_batch: int, micro_batch: int, knob: str) -> list[tuple]:
    """(value, Estimate or the ValueError's message) of layout `par` with `knob` moved over its
    values on the same GPUs: "micro_batch" over the powers of 2 up to a replica's share of the
    global batch; "tp" and "pp" over the divisors of par.world, dp taking what they leave; "zero"
    over 0-3. What a knob does to step time and memory, one layout at a time."""
    gpus, other = par.world, {"tp": par.pp, "pp": par.tp}
    values = {"micro_batch": [1 << i for i in range(20) if 1 << i <= global_batch // par.dp],
              **{k: [d for d in range(1, gpus + 1) if gpus % (d * o) == 0]
                 for k, o in other.items()},
              "zero": [0, 1, 2, 3]}
    if knob not in values:
        raise ValueError(f"knob must be one of {sorted(values)}, got {knob!r}")
    points = []
    for v in values[knob]:
        b, change = (v, {}) if knob == "micro_batch" else (micro_batch, {knob: v})
        if knob in other:
            change["dp"] = gpus // (v * other[knob])
        if knob == "tp":  # sequence parallelism needs tp > 1
            change["sequence_parallel"] = par.sequence_parallel and v > 1
        try:
            points.append((v, estimate(cfg, par.replace(**change), cluster, global_batch, b)))
        except ValueError as e:
            points.append((v, str(e)))
    return points
