"""A layout's step time on this machine's CPU cores: gpu_time.py's
model, changed where a CPU is different.

`planner.estimate` comes here when its Cluster carries a CPU calibration (`planner.this_machine`,
calibrate.py); the memory is the same either way (memory.predict's
exact count). What changes, and why:
  compute       the model's own layer, ends, per-action overhead and optimizer step, as
                `layer_profile.profile` times them (Python and dispatch are most of a small model's
                time: FLOPs over a peak would miss it several times; matmul_fit.py fits
                gpu_time's matmul model to this CPU, and its matmuls are a third to 60% of a layer)
  no overlap    collectives run on the cores that compute, so every TP, PP and DP message is paid in
                full (gpu_time.py hides DP buckets under the backward; a small model's gradients
                fill one bucket, sent after the backward anyway)
  time-sharing  `world` ranks of `threads` threads on `cores` cores: while k ranks compute at once,
                each runs at speed(k) = min(1, sharing * slots / k), slots = cores // threads
                (calibrate.CPU). DP and TP ranks compute in lockstep; a pipeline's ranks do not (its
                warm-up and cool-down run fewer ranks at once), so its schedule is replayed with the
                speeds shared (`replay_shared`)
  meeting       a collective entered from compute first pays `meet` (a woken process, a late peer),
                then its ring steps; one that follows another back to back pays the steps only

Per micro-batch, on a rank holding n layers of a chunk, t = tp,
X = b s h e bytes (e = 4 fp32, 2 bf16):
  F work  n layer_fwd + [first chunk] emb_fwd + [last] head_fwd + action_fwd; B, W likewise
  TP      no SP: per layer 2 all-reduces of X in F and 2 in B (+1 in B with full recompute: the
          recomputed forward stops after the attention's); 1 in F after the embedding; 1 in B before
          the head; the loss 2 all-reduces and 1 all-gather of 4 b s bytes in F. With SP each
          all-reduce becomes an all-gather + a reduce-scatter, backward gathers every
          column-parallel input again (2 a layer, 1 for the head; full recompute +2 gathers and +1
          scatter a layer), and once a step one all-reduce of the shard-used gradients
          (`tp_collectives`; `collective_calls` counts them for the tests).
          Ring: meet + steps (step + X / (t bandwidth)), steps 2(t-1)
          for an all-reduce, t-1 otherwise
  PP      per chunk boundary, per micro-batch, each way: meet + step + X / bandwidth (X / t with SP)
Per step, after the pipeline, all ranks at once:
  DP      ZeRO-0 all-reduce of 4 Psi bytes: fp32 gradients in bucket_mb buckets (one a tensor if
          dp_mode is "naive"), mixed precision's fp32 master gradients one tensor at a time
          (parallelize.py); ZeRO-1/2 a reduce-scatter of g Psi and an all-gather of p Psi bytes;
          ZeRO-3 per micro-batch and unit 2 all-gathers and 1 reduce-scatter
  optimizer  the profile's step on the rank's layers and ends; with ZeRO 1/dp of it + the flat
             copies
          (g + p) Psi / copy_rate; all / speed(world)
  loss    summed over the dp and the pp groups: an all-reduce of 8 bytes each
"""
from __future__ import annotations

from minipar import memory, pipeline
from minipar.data_parallel import split
from minipar.pipeline.schedules import inputs
from minipar.planner.layer_profile import profile

def ring(kind: str, nbytes: float, n: int, cpu, meet: bool = True) -> float:
    """Seconds of minipar's ring collective `kind` ("all_reduce", "all_gather", "reduce_scatter")
    whose full tensor is `nbytes`, over n ranks; meet: the ranks arrive from compute (pay the wait
    to meet), else the collective follows another one back to back."""
    if n == 1:
        return 0.0
    steps, (sync, latency, bandwidth) = (2 if kind == "all_reduce" else 1) * (n - 1), cpu.link(n)
    return sync * meet + steps * (latency + nbytes / n / bandwidth)


def tp_collectives(cfg, par, b: int, e: int) -> dict[str, list[tuple[str, float]]]:
    """The TP collectives of one micro-batch (module docstring) as [(kind, full tensor bytes)], per
    place: {"layer_F", "layer_B" (one layer), "emb_F", "emb_B" (first
    chunk), "head_F", "head_B" (last chunk)}."""
    X, small, full = b * cfg.seq_len * cfg.d_model * e, 4 * b * cfg.seq_len, par.recompute == "full"
    if par.tp == 1:
        return {k: [] for k in ("layer_F", "layer_B", "emb_F", "emb_B", "head_F", "head_B")}
    ar, ag, rs = ("all_reduce", X), ("all_gather", X), ("reduce_scatter", X)
    loss = [("all_reduce", small)] * 2 + [("all_gather", small)]
    if not par.sequence_parallel:
        return dict(layer_F=[ar] * 2, layer_B=[ar] * (3 if full else 2), emb_F=[ar], emb_B=[],
                    head_F=loss,
                    head_B=[ar])
    return dict(layer_F=[ag, rs] * 2,
                layer_B=[rs, ag] * 2 + [ag] * 2 + ([ag, ag, rs] if full else []),
                emb_F=[rs], emb_B=[ag], head_F=[ag] + loss, head_B=[rs, ag])


def tp_comm(cfg, par, b: int, e: int, cpu) -> dict[str, float]:
    """Seconds of the TP collectives of one micro-batch, per place (`tp_collectives`)."""
    return {k: sum(ring(kind, x, par.tp, cpu, meet=i == 0 or x > 4 * b * cfg.seq_len) for i,
                   (kind, x) in enumerate(v))
            # the loss's small ones follow each other
            for k, v in tp_collectives(cfg, par, b, e).items()}


def collective_calls(cfg, est) -> dict[str, int]:
    """The collectives pipeline rank 0 (the first stage) calls in a step,
    by kind, as a comm.CommStats counts them (its `calls`)."""
    par, chunks, m = est.par, len(est.layers), est.shares[0]
    places = tp_collectives(cfg, par, est.micro_batch, memory.element_bytes(par.precision))
    calls: dict[str, int] = {}
    for c in range(0, chunks, par.pp):
        for place, times in (("layer", est.layers[c]), ("emb", c == 0), ("head", c == chunks - 1)):
            for kind, _ in places[place + "_F"] + places[place + "_B"]:
                calls[kind] = calls.get(kind, 0) + m * times
    if par.tp > 1 and par.sequence_parallel:  # the shard-used parameters' gradients
        calls["all_reduce"] = calls.get("all_reduce", 0) + 1
    if par.dp > 1 and par.zero < 3:  # a collective a gradient buffer (`_buckets`)
        sizes = memory.rank_units(cfg, par.tp, list(est.layers), par.pp, 0, of=memory.chunk_params)
        k = _buckets(par, sizes, memory.layout_bytes(par.precision, par.reduce_fp32))
        if par.zero == 0:
            calls["all_reduce"] = calls.get("all_reduce", 0) + k
        else:
            calls.update(reduce_scatter=calls.get("reduce_scatter", 0) + par.reductions * k,
                         all_gather=calls.get("all_gather", 0) + k)
    return {k: v for k, v in calls.items() if v}


def speed(cpu, k: float) -> float:
    """Each rank's speed while k ranks compute at once (1: as fast as alone)."""
    return min(1.0, cpu.sharing * cpu.slots / k) if k > 0 else 1.0


def replay_shared(actions, chunks: int, work: dict, wait: dict, latency: float, copies: int, cpu,
                  record: list | None = None, slow: list | None = None):
    """Replay a schedule as `pipeline.schedules.replay` does, but with the cores shared: an action
    is `work` seconds of computing (at full speed) then `wait` seconds of collectives; while k ranks
    of the pipeline compute, each goes at speed(k * copies) (copies: the
    replicas and TP ranks doing the same). slow[r] (emulated kinds, `calibrate.emulate`): pipeline
    rank r then sleeps (slow[r] - 1) times the action's time, off the cores, as the throttle does.
    work, wait: {op: [seconds per chunk]}. Returns (makespan, per rank (computing, waiting)
    seconds, a throttled rank's sleep counted as computing); record, if given, gets per rank
    [(action, start, end)] (a `pipeline.Timeline`'s events)."""
    # long: one event loop whose phases (ready, work, wait, sleep) share the ranks' state
    p = len(actions)
    slow = slow or [1.0] * p
    if record is not None:
        record[:] = [[] for _ in range(p)]
    nxt, phase, left, until = [0] * p, [None] * p, [0.0] * p, [0.0] * p
    done, spent, now, started = {}, [[0.0, 0.0] for _ in range(p)], 0.0, [0.0] * p
    rank_of = {a: r for r, ops in enumerate(actions) for a in ops}
    while True:
        changed = True
        while changed:  # start and finish what can be at `now`
            changed = False
            for r in range(p):
                if phase[r] == "work" and left[r] <= 1e-12:
                    a = actions[r][nxt[r]]
                    phase[r], until[r] = "wait", now + wait[a.op][a.stage]
                    changed = True
                if phase[r] == "wait" and until[r] <= now + 1e-12 and slow[r] > 1.0:
                    spent[r][0] += (slow[r] - 1.0) * (now - started[r])
                    phase[r], until[r] = "sleep", now + (slow[r] - 1.0) * (now - started[r])
                if phase[r] in ("wait", "sleep") and until[r] <= now + 1e-12:
                    done[actions[r][nxt[r]]] = now
                    if record is not None:
                        record[r].append((actions[r][nxt[r]], started[r], now))
                    spent[r][1] += wait[actions[r][nxt[r]].op][actions[r][nxt[r]].stage]
                    phase[r], nxt[r] = None, nxt[r] + 1
                    changed = True
                if phase[r] is None and nxt[r] < len(actions[r]):
                    a = actions[r][nxt[r]]
                    needs = inputs(a, chunks)
                    if all(d in done for d in needs):
                        ready = max([now] + [done[d] + (latency if rank_of[d] != r else 0.0)
                                             for d in needs])
                        if ready <= now + 1e-12:
                            phase[r], left[r], started[r] = "work", work[a.op][a.stage], now
                            changed = True
                        else:
                            phase[r], until[r] = "ready", ready
                if phase[r] == "ready" and until[r] <= now + 1e-12:
                    a = actions[r][nxt[r]]
                    phase[r], left[r], started[r] = "work", work[a.op][a.stage], now
                    changed = True
        busy = [r for r in range(p) if phase[r] == "work"]
        v = speed(cpu, len(busy) * copies)
        events = [now + left[r] / v for r in busy] + [until[r] for r in range(p)
                                                      if phase[r] in ("wait", "sleep", "ready")]
        if not events:
            break
        step = max(min(events) - now, 0.0)
        for r in busy:
            left[r] -= step * v
            spent[r][0] += step
        now += step
    if any(nxt[r] < len(actions[r]) for r in range(p)):
        raise RuntimeError("the schedule deadlocks")
    return now, spent


def _buckets(par, sizes: list[int], per: dict) -> int:
    """Gradient buffers a rank holding parameters of these sizes reduces, one collective each
    (data_parallel.split): DP naive a tensor each, ZeRO-1/2 naive one flat buffer, else buckets of
    par.bucket_mb at per["grads"] bytes an element."""
    if par.dp_mode == "naive":
        return len(sizes) if par.zero == 0 else 1
    return len(split(sizes, par.bucket_bytes, per["grads"]))


def dp_comm(par, psi: int, buckets: int, units: int, cpu, per: dict) -> float:
    """Seconds of the DP / ZeRO collectives of a rank holding psi parameters in `buckets` gradient
    buffers (`_buckets`; ZeRO-3: `units` units), at `per` bytes a parameter
    (memory.layout_bytes); bucketed ZeRO-2 reduce-scatters every micro-batch."""
    n = par.dp
    if n == 1:
        return 0.0
    extra = lambda kind, k: (k - 1) * ring(kind, 0, n, cpu, meet=False)  # noqa: E731
    if par.zero == 0:  # after the backward, then back to back
        return extra("all_reduce", buckets) + ring("all_reduce", per["grads"] * psi, n, cpu)
    rs, ag = ring("reduce_scatter", per["grads"] * psi, n, cpu), ring("all_gather",
                                                                      per["params"] * psi, n, cpu)
    if par.zero in (1, 2):
        return par.reductions * (rs + extra("reduce_scatter", buckets)) + ag + extra("all_gather",
                                                                                  buckets)
    return par.microbatches * (2 * ag + rs + (3 * units - 3) * ring("all_gather", 0, n, cpu,
                                                                    meet=False))


def optimizer_time(par, psi: int, full: float, cpu, per: dict) -> float:
    """Seconds of the optimizer step of a rank holding psi parameters, whose whole step (`profile`)
    takes `full` seconds: that, or with ZeRO its 1/dp share plus the
    flat copies of (g + p) psi bytes."""
    if par.zero == 0:
        return full
    return full / par.dp + (per["grads"] + per["params"]) * psi / cpu.copy_rate


def _pipeline(cfg, est, e: int):
    """What `replay_shared` replays for `est`, e bytes an activation element: (profile, actions,
    chunks, work, wait, latency)."""
    par, cpu, b = est.par, est.cluster.cpu, est.micro_batch
    if par.world != cpu.world:
        raise ValueError(f"this CPU calibration is for world={cpu.world} ranks (threads and "
                         "time-sharing depend "
                         f"on it); the layout has {par.world}: use "
                         f"planner.this_machine(world={par.world})")
    if len(set(est.shares)) != 1:
        raise ValueError("the CPU model covers even DP shares only")
    slow = [[max(g.cpu.slowdown for g in parts) for parts in replica]
            for replica in est.cluster.tp_parts(par.dp, par.tp, par.pp, par.stage_tp)]
    if any(s != slow[0] for s in slow):
        raise ValueError("the CPU model covers replicas of the same emulated kinds only, stage by "
                         f"stage (slowdowns per replica: {slow})")
    mode = "plain" if par.pp == 1 else "split" if par.schedule == "zb-h1" else "pipe"
    prof = profile(cfg, b, par.tp, par.sequence_parallel, par.recompute, par.precision,
                   cpu.threads, mode)
    p, chunks, m = par.pp, len(est.layers), est.shares[0]
    tp = tp_comm(cfg, par, b, e, cpu)
    work, wait = {"F": [], "B": [], "W": []}, {"F": [], "B": [], "W": []}
    for c, n in enumerate(est.layers):
        first, last = c == 0, c == chunks - 1
        work["F"].append(
            n * prof.layer_fwd + first * prof.emb_fwd + last * prof.head_fwd + prof.action_fwd
        )
        work["B"].append(
            n * prof.layer_bwd + first * prof.emb_bwd + last * prof.head_bwd + prof.action_bwd
        )
        # W of the embeddings, the head
        work["W"].append(n * prof.layer_w + (first + last) / 2 * prof.ends_w)
        wait["F"].append(n * tp["layer_F"] + first * tp["emb_F"] + last * tp["head_F"])
        wait["B"].append(n * tp["layer_B"] + first * tp["emb_B"] + last * tp["head_B"])
        wait["W"].append(0.0)
    x = b * cfg.seq_len * cfg.d_model * e / (par.tp if par.sequence_parallel else 1)
    sync, step, bandwidth = cpu.link(2)
    latency = sync + step + x / bandwidth if p > 1 else 0.0
    actions = pipeline.cached_schedule(par.schedule if p > 1 else "1f1b", p, m, par.virtual_stages)
    return prof, actions, chunks, work, wait, latency, slow[0]


def step_time(cfg, est) -> tuple[float, dict, pipeline.Timeline]:
    """(seconds, breakdown by planner.TERMS, the replayed pipeline) of `est`'s layout on its
    Cluster's CPU (module docstring). The Timeline is the schedule as replayed with the cores
    shared, in seconds, the DP and optimizer time after it left out (what `viz_pipeline.gantt` draws
    beside a measured one)."""
    par, cpu, p = est.par, est.cluster.cpu, est.par.pp
    if par.stage_tp:
        raise ValueError(f"the CPU model times layouts of one tp, not stage_tp {par.stage_tp}: "
                         "they run here (minipar.train) and are timed on GPU clusters")
    per = memory.layout_bytes(par.precision, par.reduce_fp32)
    e = memory.element_bytes(par.precision)
    prof, actions, chunks, work, wait, latency, slow = _pipeline(cfg, est, e)
    events = []
    span, spent = replay_shared(actions, chunks, work, wait, latency, par.dp * par.tp, cpu, events,
                                slow)
    busiest = max(range(p), key=lambda r: sum(spent[r]))
    dp = opt = sp = 0.0
    for r in range(p):
        mine, units = range(r, chunks, p), memory.rank_units(cfg, par.tp, list(est.layers), p, r)
        sizes = memory.rank_units(cfg, par.tp, list(est.layers), p, r, of=memory.chunk_params)
        dp = max(dp, dp_comm(par, sum(units), _buckets(par, sizes, per), len(units), cpu, per))
        full = sum(
            est.layers[c] * prof.layer_opt + ((c == 0) + (c == chunks - 1)) / 2 * prof.ends_opt
            for c in mine
        )
        opt = max(opt, optimizer_time(par, sum(units), full, cpu, per) / speed(cpu, par.world))
        if par.sequence_parallel:  # the shard-used parameters' gradients, summed over the TP group
            partial = sum(memory.replicated_params(cfg, est.layers[c], c == 0, c == chunks - 1)
                          for c in mine)
            sp = max(sp, ring("all_reduce", partial * per["grads"], par.tp, cpu))
    loss = ring("all_reduce", 8, par.dp, cpu) + ring("all_reduce", 8, p, cpu)
    computing, waiting = spent[busiest]
    breakdown = {"compute": computing, "recompute": 0.0, "memory_bound": 0.0,
                 "tp_comm": waiting + sp, "cp_comm": 0.0, "ep_comm": 0.0,
                 "bubble": 0.0, "pp_p2p": 0.0, "dp_comm": dp + loss, "optimizer": opt}
    idle = max(0.0, span - computing - waiting)
    breakdown["bubble" if p > 1 else "compute"] += idle  # pp = 1: the time-sharing
                                                         #   slowdown is compute
    return sum(breakdown.values()), breakdown, pipeline.Timeline(events)
