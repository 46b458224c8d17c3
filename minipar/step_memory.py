"""The memory of a whole training step at its peak, predicted (`predict_peak`); train measures it
(`TrainResult.step_peak`, from tensor lifetimes: minipar/tracker.py).

memory.predict tallies what a rank holds after a step (model states, buffers) and the activations
at their most. The step's real peak is at one of a few moments, and which one depends on the
technique (M micro-batches, g bytes a gradient element):

  forward   the end of the last micro-batch's forward: every activation alive, beside what is held
            between steps. DP and ZeRO-1 keep all their gradient buffers between steps, so this is
            their peak, and it is the tally exactly. Bucketed ZeRO-2 with M > 1 also holds the
            previous micro-batch's last bucket, still in flight, and the shard it lands in.
  backward  the first gradient: the loss's and the head's saved tensors are gone (4 sbV + 4 + 8 sb,
            the log-probabilities and the targets; sbhe, the head's input) and ZeRO-2 allocates its
            first full gradient buffer: the whole flat buffer in the simple version (which then
            lives until the step: with M > 1 it is alive at the forward moment too), the first
            bucket when bucketed (with M > 1 beside the previous micro-batch's last one).
  step      the optimizer step: no activations; with 16-bit gradients (reduce_fp32=False) outside
            ZeRO, the fp32 copies the masters step on, 4 Psi.
Not counted, as the measured "held" peak leaves them out: autograd's and the optimizer's
temporaries (intermediate gradients, AdamW's sqrt and division), shown beside it as "temporaries".

Covered: tp = pp = 1 and ZeRO stages 0-2. ZeRO-3, whose peak falls in backward among the gathered
units, and bucketed ZeRO-2 whose later buckets (two in flight) could outgrow what backward has
freed by then raise NotImplementedError rather than guess.
"""
from __future__ import annotations

from minipar import memory
from minipar.comm import receive_numel
from minipar.data_parallel import split


def predict_peak(cfg, par, global_batch: int, rank: int = 0) -> dict:
    """{category: bytes} of DP rank `rank` at its step's peak (the categories of memory.predict),
    and "phase": the moment (see the module docstring)."""
    if par.tp > 1 or par.pp > 1 or par.recompute != "none":
        raise NotImplementedError("predict_peak covers dp alone, without recomputation")
    if par.zero == 3:
        return _zero3_peak(cfg, par, global_batch, rank)
    tally = memory.predict(cfg, par, global_batch, rank=rank)
    tally["optimizer"] += 4 * _pieces(cfg, par, rank)  # AdamW's step counters, one a tensor
    g = memory.layout_bytes(par.precision, par.reduce_fp32)["grads"]
    b, m = par.dp_rows(global_batch)[rank] // par.microbatches, par.microbatches
    s, h, V = cfg.seq_len, cfg.d_model, cfg.vocab_size
    freed = s * b * h * memory.element_bytes(par.precision) + 4 * s * b * V + 4 + 8 * s * b
    moments = {"forward": dict(tally)}
    if par.zero == 2:
        full = _buffers(cfg, par, g)  # (full bytes, shard bytes) of each gradient buffer
        first, last = full[0], full[-1]
        before = moments["forward"]
        if par.dp_mode == "naive" and m > 1:
            before["grads"] += first[0]
        elif m > 1:  # the previous micro-batch's last bucket, in flight
            before["grads"], before["comm"] = before["grads"] + last[0], before["comm"] + last[1]
        extra = last if par.dp_mode == "bucketed" and m > 1 else (0, 0)
        moments["backward"] = dict(tally, activations=tally["activations"] - freed,
                                   grads=tally["grads"] + first[0] + extra[0],
                                   comm=tally["comm"] + extra[1])
        # bucket k+1's first gradient: k in flight (and its landing shard) beside it, while
        # backward has freed at least the loss's and the head's activations
        later = [a[0] + a[1] + c[0] for a, c in zip(full, full[1:])]
        if later and max(later) + extra[0] + extra[1] > freed:
            raise NotImplementedError("a later bucket of ZeRO-2 may make the peak: buckets in "
                                      "flight outgrow the activations backward has freed")
    mixed = par.precision in ("bf16", "fp16")
    if par.zero == 0 and mixed and not par.reduce_fp32:  # the fp32 master gradients
        psi = memory.tp_params(cfg)
        moments["step"] = dict(tally, activations=0, grads=tally["grads"] + 4 * psi)
    phase = max(moments, key=lambda k: sum(moments[k].values()))
    return {**moments[phase], "phase": phase}


def _flats(cfg, par, g: int) -> list[list[int]]:
    """The parameters' sizes in each ZeRO-1/2 flat buffer, in its order: one buffer of all, in
    the model's order (dp_mode "naive"), or data_parallel.split's buckets, in backward's."""
    sizes = memory.chunk_params(cfg, 1, cfg.n_layer, True, True)
    if par.dp_mode == "naive":
        return [sizes]
    return [[sizes[i] for i in b] for b in split(sizes, int(par.bucket_mb * 2**20), g)]


def _pieces(cfg, par, rank: int) -> int:
    """Tensors AdamW steps on DP rank `rank`: every parameter (its fp32 master) without ZeRO, else
    each piece of a parameter that falls in the rank's shard of a flat buffer (zero.Flat.adamw)."""
    if par.zero == 0:
        return len(memory.chunk_params(cfg, 1, cfg.n_layer, True, True))
    g = memory.layout_bytes(par.precision, par.reduce_fp32)["grads"]
    return sum(_in_shard(sizes, par.dp, rank) for sizes in _flats(cfg, par, g))


def _buffers(cfg, par, g: int) -> list[tuple[int, int]]:
    """(full, shard) bytes of each ZeRO-1/2 gradient buffer (`_flats`), padded to N shards."""
    shards = [memory.flat_shard(sum(sizes), par.dp, 0)[0] for sizes in _flats(cfg, par, g)]
    return [(g * par.dp * shard, g * shard) for shard in shards]


def _zero3_peak(cfg, par, global_batch: int, rank: int) -> dict:
    """ZeRO-3's peak, by walking its step as zero3.Zero3 runs it, unit by unit (forward order:
    the embeddings, the blocks, ln_f, the head). A unit is gathered before its forward, the next one
    prefetched, and freed after it; in backward gathered when its output's gradient is ready (after
    the loss's backward, for the head), the one before prefetched; once its gradients are in (its
    activations all freed), they are flattened (g N shard), reduced into a landing shard (g shard)
    while at most two reductions before it are still held, and the unit freed. The step's first
    reduction makes the ring's receive space, each unit's first its gradient shard (kept to the
    step). Every allocation is a moment to check."""
    # long: one pass over the step's events, a line or two each, as zero3.Zero3 runs them
    per = memory.layout_bytes(par.precision, par.reduce_fp32)
    p, g, n = per["params"], per["grads"], par.dp
    sizes = _unit_sizes(cfg)
    flats = [memory.flat_shard(sum(unit), n, rank) for unit in sizes]
    shards = [shard for shard, _ in flats]
    master = 4 if par.precision in ("bf16", "fp16") else 0
    state = {"params": p * sum(shards),
             "optimizer": master * sum(shards) + (per["optimizer"] - master)
             * sum(o for _, o in flats) + 4 * sum(_in_shard(unit, n, rank) for unit in sizes)}
    b = par.dp_rows(global_batch)[rank] // par.microbatches
    s, h, V, a = cfg.seq_len, cfg.d_model, cfg.vocab_size, cfg.n_head
    e = memory.element_bytes(par.precision)
    x, st = s * b * h * e, 2 * s * b * e
    saved = [8 * s * b, 8 * s] + [16 * x + 2 * st + 4 * a * s * b] * cfg.n_layer + [x + st, x]
    loss, u = 4 * s * b * V + 4 + 8 * s * b, len(sizes)
    live = {"gathered": set(), "pending": [], "shards": set(), "scratch": 0, "act": 0}
    best = {}

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

    def gather(i, phase):
        if 0 <= i < u and i not in live["gathered"]:
            live["gathered"].add(i)
            check(phase)

    for _ in range(par.microbatches):
        for i in range(u):  # forward
            gather(i, "forward")
            gather(i + 1, "forward")
            live["act"] += saved[i]
            check("forward")
            live["gathered"].discard(i)
        live["act"] += loss
        check("forward")
        live["act"] -= loss  # the loss's backward, before the head's output has its gradient
        for i in reversed(range(u)):  # backward
            gather(i, "backward")
            gather(i - 1, "backward")
            live["act"] -= saved[i]
            live["pending"].append(i)
            live["scratch"] = live["scratch"] or g * receive_numel(n * max(shards), n)
            live["shards"].add(i)
            check("backward")
            live["pending"] = live["pending"][-2:]  # the oldest retired
            live["gathered"].discard(i)
    return best


def _unit_sizes(cfg) -> list[list[int]]:
    """The parameters' sizes of each ZeRO-3 unit, in forward order (t = 1)."""
    sizes, blocks = memory.chunk_params(cfg, 1, cfg.n_layer, True, True), cfg.n_layer
    per_block = (len(sizes) - 6) // blocks
    return [sizes[:1], sizes[1:2]] + [sizes[2 + k * per_block: 2 + (k + 1) * per_block]
                                      for k in range(blocks)] + [sizes[-4:-2], sizes[-2:]]


def _in_shard(sizes: list[int], n: int, rank: int) -> int:
    """Parameters (of these sizes, laid out in order in a flat buffer padded to n shards) that
    have elements in `rank`'s shard: AdamW's pieces, each with a step counter."""
    shard, start, count = memory.flat_shard(sum(sizes), n, rank)[0], 0, 0
    lo, hi = rank * shard, (rank + 1) * shard
    for size in sizes:
        count += max(start, lo) < min(start + size, hi)
        start += size
    return count
