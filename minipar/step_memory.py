"""The memory of a whole training step at its peak, predicted (`predict_peak`); train measures it
(`TrainResult.step_peak`, from tensor lifetimes: minipar/tracker.py).

memory.predict tallies what a rank holds after a step (model states, buffers) and the activations
at their most. The step's real peak is at one of a few moments, and which one depends on the
technique. Data parallelism (ZeRO-0) has two (M micro-batches):

  forward   the end of the last micro-batch's forward: every activation alive, beside what is held
            between steps (DP keeps its gradient buckets and receive space): the tally exactly.
  step      the optimizer step: no activations; with 16-bit gradients (reduce_fp32=False), the
            fp32 copies the masters step on, 4 Psi.
Not counted, as the measured "held" peak leaves them out: autograd's and the optimizer's
temporaries (intermediate gradients, AdamW's sqrt and division), shown beside it as "temporaries".

ZeRO-1/2 and ZeRO-3 make and free buffers inside the step, so they are walked event by event
(`_buckets_peak`, `_zero3_peak`): backward node by node, each node freeing what it saved, each
gradient reaching its bucket or unit, as data_parallel.GradBuckets and zero3.Zero3 allocate and
free. Both keep what they hold deterministic (a new buffer waits for the older ones in flight),
which is what makes the peak predictable to the byte. ZeRO-1/2 hold their ring's receive space
only from the step's first reduction to its end, and ZeRO-2 its reduced shards from their first
reduction to zero_grad. Covered: ZeRO 1-3 with TP, SP and recomputation (what each node keeps,
and the order in which autograd finishes the gradients: minipar/autograd_events.py), on a pipeline
stage too (its schedule's actions walked, zb-h1's W too); without ZeRO, any layout (`zero0_peak`:
TP, SP, pipelines and recomputation keep the same two moments). A TP rank walks its own shards;
its DP rank (`rank`) decides its ZeRO shards.
"""
from __future__ import annotations

import functools

from minipar import autograd_events, memory
from minipar.comm import receive_numel
from minipar.data_parallel import split
from minipar.zero3 import unit_events


def predict_peak(cfg, par, global_batch: int, rank: int = 0, pp_rank: int = 0,
                 tally: dict | None = None) -> dict:
    """{category: bytes} of DP rank `rank` of pipeline stage `pp_rank` at its step's peak (the
    categories of memory.predict, whose tally adds each category's most and may exceed it), and
    "phase": "forward" (during a forward), "backward" (a buffer made in backward) or "step" (after
    backward). tally: memory.predict's for that rank, if at hand (the planner's stages; ZeRO-3's
    walk counts everything itself)."""
    if par.zero == 3:
        return _zero3_peak(cfg, par, global_batch, rank, pp_rank)
    tally = dict(tally or memory.predict(cfg, par, global_batch, rank=rank, pp_rank=pp_rank))
    if par.zero in (1, 2):  # AdamW's step counters, one a tensor
        tally["optimizer"] += 4 * _pieces(cfg, par, rank, pp_rank)
        return _buckets_peak(cfg, par, global_batch, rank, tally, pp_rank)
    return zero0_peak(tally, par, _sizes(cfg, par, pp_rank))


def stage_peaks(cfg, par, b: int, layers, tallies: list[dict]) -> list[dict]:
    """`predict_peak` of DP rank 0 of each pipeline stage (micro-batches of b, `layers` per chunk,
    memory.predict's `tallies`). A step repeats itself after 3 micro-batches
    (ZeRO-1 accumulates to the last, 2 and 3 reduce each alike), 1F1B and interleaved after warm-up,
    pp (2 v + 1) (GPipe's activations grow with m): as many stand for any more (tests check)."""
    if par.zero == 0:
        return [zero0_peak(tallies[r], par, memory.rank_units(cfg, par.tp, list(layers), par.pp,
                                                              r, of=memory.chunk_params))
                for r in range(par.pp)]
    m = min(par.microbatches, 3 if par.pp == 1 else par.microbatches if par.schedule == "gpipe"
            else par.pp * (2 * par.virtual_stages + 1))
    par = par.replace(microbatches=m, stage_layers=tuple(layers) if par.pp > 1 else None)
    return [predict_peak(cfg, par, par.dp * m * b, pp_rank=r, tally=tally)
            for r, tally in enumerate(tallies)]


def zero0_peak(tally: dict, par, sizes: list[int]) -> dict:
    """Without ZeRO, in any layout (TP, SP, PP, recomputation: measured alike), the peak of a rank
    whose counted memory is `tally` (memory.by_category's) and whose parameters have these `sizes`
    (each one tensor AdamW steps, with a 4-byte step counter): the end of a forward, or the step
    with 16-bit gradients (the module docstring's two moments)."""
    tally = dict(tally, optimizer=tally["optimizer"] + 4 * len(sizes))
    mixed = par.precision in ("bf16", "fp16")
    if par.dp == 1 and not (mixed and par.reduce_fp32):
        tally["grads"] = 0  # no buckets: autograd's .grad come and go in backward (temporaries)
    moments = {"forward": dict(tally)}
    if mixed and not par.reduce_fp32:  # the fp32 master gradients
        moments["step"] = dict(tally, activations=0, grads=tally["grads"] + 4 * sum(sizes))
    phase = max(moments, key=lambda k: sum(moments[k].values()))
    return {**moments[phase], "phase": phase}


def _sizes(cfg, par, pp_rank: int = 0) -> list[int]:
    """The parameters' sizes on one of the TP ranks of stage pp_rank, in the model's order."""
    return memory.rank_units(cfg, par.tp, memory.chunk_layers(cfg, par), par.pp, pp_rank,
                             of=memory.chunk_params)


def _flats(cfg, par, g: int, pp_rank: int = 0) -> list[list[int]]:
    """The parameters' sizes in each ZeRO-1/2 flat buffer, in its order: one buffer of all, in
    the model's order (dp_mode "naive"), or data_parallel.split's buckets, in backward's."""
    sizes = _sizes(cfg, par, pp_rank)
    if par.dp_mode == "naive":
        return [sizes]
    return [[sizes[i] for i in b] for b in split(sizes, par.bucket_bytes, g)]


def _pieces(cfg, par, rank: int, pp_rank: int = 0) -> int:
    """Tensors AdamW steps on DP rank `rank`: every parameter (its fp32 master) without ZeRO, else
    each piece of a parameter that falls in the rank's shard of a flat buffer (zero.Flat.adamw)."""
    if par.zero == 0:
        return len(_sizes(cfg, par, pp_rank))
    g = memory.layout_bytes(par.precision, par.reduce_fp32)["grads"]
    return sum(_in_shard(sizes, par.dp, rank) for sizes in _flats(cfg, par, g, pp_rank))


def _buffers(cfg, par, g: int, pp_rank: int = 0) -> list[tuple[int, int]]:
    """(full, shard) bytes of each ZeRO-1/2 gradient buffer (`_flats`), padded to N shards."""
    shards = [memory.flat_shard(sum(sizes), par.dp, 0)[0]
              for sizes in _flats(cfg, par, g, pp_rank)]
    return [(g * par.dp * shard, g * shard) for shard in shards]


def _zero3_peak(cfg, par, global_batch: int, rank: int, pp_rank: int = 0) -> dict:
    """ZeRO-3's peak, by walking its step as zero3.Zero3 runs it: action by action (a pipeline
    stage's schedule), unit by unit, gathered, prefetched and freed as zero3.unit_events says. A
    unit's forward adds what it saves (the loss's, after the head's; its backward frees it first);
    once its gradients are in (its activations all freed), they are flattened (g N shard), reduced
    into a landing shard (g shard) while at most two reductions before it are still held, and the
    unit freed. The step's first reduction makes the ring's receive space, each unit's
    first its gradient shard (kept until zero_grad). Every allocation is a moment to check."""
    # long: one pass over the step's events, a line or two each, as zero3.Zero3 runs them
    per = memory.layout_bytes(par.precision, par.reduce_fp32)
    p, g, n = per["params"], per["grads"], par.dp
    b = par.dp_rows(global_batch)[rank] // par.microbatches
    sizes, saved, span, loss, held = _zero3_units(cfg, par, b, pp_rank)
    flats = [memory.flat_shard(sum(unit), n, rank) for unit in sizes]
    shards = [shard for shard, _ in flats]
    master = 4 if par.precision in ("bf16", "fp16") else 0
    state = {"params": p * sum(shards),
             "optimizer": master * sum(shards) + (per["optimizer"] - master)
             * sum(o for _, o in flats) + 4 * sum(_in_shard(unit, n, rank) for unit in sizes)}
    live = {"gathered": set(), "pending": [], "shards": set(), "scratch": 0, "act": 0}
    best, last = {}, par.pp * par.virtual_stages - 1  # (the chunk with the loss)

    def check(phase):
        pending = live["pending"]
        cats = {"params": state["params"],
                "grads": sum(g * n * shards[i] for i in pending)
                + sum(g * shards[i] for i in live["shards"]),
                "optimizer": state["optimizer"], "activations": live["act"],
                "comm": sum(p * n * shards[i] for i in live["gathered"]) + live["scratch"]
                + sum(g * shards[i] for i in pending)}
        if sum(cats.values()) > sum(v for k, v in best.items() if k != "phase"):
            best.clear()
            best.update(cats, phase=phase)

    for op, c in memory.rank_actions(par, pp_rank):
        phase, head = "forward" if op == "F" else "backward", span[c][-1] if c == last else -1
        live["act"] -= loss * (op == "B" and c == last)  # the loss's backward comes first
        for event, i in unit_events(span, op, c, live["gathered"]):
            if event == "gather":
                check(phase)
            elif op == "F":
                live["act"] += saved[i]
                check(phase)
            else:
                live["act"] -= saved[i] + (held if i == head else 0)
                live["pending"].append(i)
                ring = par.collectives == "minipar"  # (the backend's need no receive space of ours)
                live["scratch"] = live["scratch"] or ring * g * receive_numel(n * max(shards), n)
                live["shards"].add(i)
                check(phase)
                live["pending"] = live["pending"][-2:]  # the oldest retired
        if op == "F" and c == last:  # the loss, after the head is freed
            live["act"] += loss + held
            check(phase)
    return best


def _zero3_units(cfg, par, b: int, pp_rank: int = 0):
    """ZeRO-3's units on one TP rank of pipeline stage pp_rank, in forward order: (each unit's
    parameters' sizes, what each saves in a forward of micro-batch b, {chunk: its units' indices},
    what the loss saves and what of it outlives its node (memory.loss_bytes))."""
    e, layers = memory.element_bytes(par.precision), memory.chunk_layers(cfg, par)
    sizes, saved, span = [], [], {}
    held = memory.loss_bytes(cfg, b, par.tp, e)[1]
    for c in range(pp_rank, len(layers), par.pp):
        first, last, k = c == 0, c == len(layers) - 1, layers[c]
        events = autograd_events.backward_events(cfg.replace(n_layer=k), b, e, par.recompute,
                                                 par.tp, par.sequence_parallel)
        units = memory.unit_params(cfg, par.tp, k, first, last)
        span[c] = range(len(sizes), len(sizes) + len(units))
        sizes += units
        saved += [events[-1][0], events[-2][0]] * first + \
            [sum(freed for freed, _ in events[3:-2]) // k] * k + \
            [events[2][0], events[1][0] - held] * last
    return sizes, saved, span, events[0][0], held


def _in_shard(sizes: list[int], n: int, rank: int) -> int:
    """Parameters (of these sizes, laid out in order in a flat buffer padded to n shards) that
    have elements in `rank`'s shard: AdamW's pieces, each with a step counter."""
    shard, start, count = memory.flat_shard(sum(sizes), n, rank)[0], 0, 0
    lo, hi = rank * shard, (rank + 1) * shard
    for size in sizes:
        count += max(start, lo) < min(start + size, hi)
        start += size
    return count


def _buckets_peak(cfg, par, global_batch: int, rank: int, tally: dict, pp_rank: int = 0) -> dict:
    """ZeRO-1/2's peak: `tally` with its activations, comm and grads at the walk's fullest moment
    (`_buckets_walk`; the other states do not change during a step, so they do not move it)."""
    b = par.dp_rows(global_batch)[rank] // par.microbatches
    return {**tally, **_buckets_walk(cfg, par, b, pp_rank)}


@functools.lru_cache(maxsize=4096)   # a plan walks each layout once; the next plan, on another
def _buckets_walk(cfg, par, b: int, pp_rank: int) -> dict:   # cluster, the same layouts again
    """ZeRO-1/2's fullest moment, by walking backward node by node (`autograd_events`) through
    data_parallel.GradBuckets' rules. Stage 1 keeps its full buffers; stage 2 makes one at its
    first gradient (after retiring every bucket in flight but the newest) and frees it when
    retired (or refilled: the next micro-batch's), its shard, reduced in place, copied out first
    (the step's first reduction of that bucket) or added to the step's. A bucket is launched once
    complete: bucketed stage 2 every micro-batch, bucketed stage 1 in the last, naive (one flat
    buffer) in finish, which launches what is left and retires everything. The ring's receive
    space lives from the step's first launch to finish. Each allocation, and each forward's end,
    is a moment to check. A pipeline stage walks its schedule's actions (`stage_ops`); its step
    runs in no_sync, so stage 1 reduces in finish only."""
    # long: one pass over the step's events, as GradBuckets runs them
    g = memory.layout_bytes(par.precision, par.reduce_fp32)["grads"]
    sizes, n, keep = _sizes(cfg, par, pp_rank), par.dp, par.zero == 1
    groups = [list(range(len(sizes)))] if par.dp_mode == "naive" else \
        split(sizes, par.bucket_bytes, g)
    bucket_of = {i: k for k, group in enumerate(groups) for i in group}
    full = _buffers(cfg, par, g, pp_rank)
    ring = n > 1 and par.collectives == "minipar"
    scratch = ring * g * receive_numel(max(f for f, _ in full) // g, n)
    m = par.microbatches
    live = {"full": set(), "shards": set(), "launched": [], "act": 0, "scratch": 0, "grads": 0}
    arrived, best, nxt, rounds = [0] * len(groups), {}, [0], [0]

    def check(phase):  # (totals kept as they change: a plan walks thousands of these)
        total = live["act"] + live["scratch"] + live["grads"]
        if total > best.get("total", -1):
            best.update(activations=live["act"], comm=live["scratch"], grads=live["grads"],
                        phase=phase, total=total)

    def hold(k):  # a full buffer made
        live["full"].add(k)
        live["grads"] += full[k][0]

    def launch(k, phase="backward"):
        arrived[k] = 0
        if not live["scratch"]:
            live["scratch"] = scratch
            check(phase)
        if k not in live["full"]:  # (a bucket no gradient reached: zeros)
            hold(k)
        live["launched"].append(k)
        nxt[0] = (k + 1) % len(groups)
        rounds[0] += nxt[0] == 0

    def retire(ks, phase="backward"):
        for k in ks:
            if not keep and k not in live["shards"]:  # copied out of the bucket
                live["shards"].add(k)
                live["grads"] += full[k][1]
                check(phase)
            if not keep and k in live["full"]:
                live["full"].discard(k)
                live["grads"] -= full[k][0]
            live["launched"].remove(k)

    for k in range(len(groups)) if keep else []:
        hold(k)
    backwards = 0
    for op, events in autograd_events.stage_ops(cfg, par, b, pp_rank):
        if op == "F":
            live["act"] += sum(freed for freed, _ in events)
            check("forward")
            continue
        backwards += 1
        if keep and (par.pp > 1 or par.dp_mode == "naive"):  # no buffer made or launched here
            live["act"] -= sum(freed for freed, _ in events)
            continue
        for freed, params in events:
            live["act"] -= freed
            for i in params:
                k = bucket_of[i]
                if k in live["launched"]:
                    retire([k])
                if k not in live["full"]:
                    retire(live["launched"][:-1])
                    hold(k)
                    check("backward")
                if par.dp_mode == "naive" or (keep and backwards < m):
                    continue  # (kept buffers count the micro-batch that launches them)
                arrived[k] += 1
                while arrived[nxt[0]] == len(groups[nxt[0]]):
                    launch(nxt[0])
                    if nxt[0] == 0:
                        break
    for k in range(nxt[0], len(groups)) if nxt[0] or not rounds[0] else []:
        launch(k, "step")  # finish
    retire(list(live["launched"]), "step")
    best.pop("total")
    return best
