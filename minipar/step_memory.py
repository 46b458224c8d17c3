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
from minipar.data_parallel import split


def predict_peak(cfg, par, global_batch: int, rank: int = 0) -> dict:
    """{category: bytes} of DP rank `rank` at its step's peak (the categories of memory.predict),
    and "phase": the moment (see the module docstring)."""
    if par.tp > 1 or par.pp > 1 or par.zero == 3:
        raise NotImplementedError("predict_peak covers ZeRO stages 0-2 with dp alone")
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
    count = 0
    for sizes in _flats(cfg, par, g):
        shard, start = memory.flat_shard(sum(sizes), par.dp, rank)[0], 0
        lo, hi = rank * shard, (rank + 1) * shard
        for size in sizes:
            count += max(start, lo) < min(start + size, hi)
            start += size
    return count


def _buffers(cfg, par, g: int) -> list[tuple[int, int]]:
    """(full, shard) bytes of each ZeRO-1/2 gradient buffer (`_flats`), padded to N shards."""
    shards = [memory.flat_shard(sum(sizes), par.dp, 0)[0] for sizes in _flats(cfg, par, g)]
    return [(g * par.dp * shard, g * shard) for shard in shards]
