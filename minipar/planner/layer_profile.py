"""The model's own layer, timed: what one rank computes of a micro-batch,
for the CPU cost model (cpu_time.py).

`profile(cfg, b, tp, sp, recompute, precision, threads, mode)` is measured when an estimate first
needs it (cached per process), in this process with the ranks'
thread count, with the real modules of a
training run: tensor_parallel's shards with their collectives replaced by local no-ops (rank 0's
shapes), recompute, MixedPrecision's autocast, the activation meter, the loss, and the optimizer
step (MixedPrecision.step: AdamW, with bf16's fp32 masters). Through train's own loop ("plain", pp =
1) or a one-rank PipelineExecutor ("pipe"; "split": B and W apart, for
   zb-h1). A GPT of 1 and of 3 blocks, median
of 15 micro-steps after two warm-ups:
  layer_*       (3 blocks - 1 block) / 2: forward, backward (B), W, optimizer step
  emb_*, head_* the embeddings alone, and ln_f + head + loss alone
  (on a random hidden state), timed apart
  action_*      1 block - layer - emb - head: what each action costs besides (the loop's, the
                executor's)
  ends_w, ends_opt  1 block - layer: W and the optimizer step of the embeddings, ln_f and the head
The collectives are not in it: cpu_time.py charges them from the links calibrate.py measures.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import NamedTuple

import torch

from minipar import comm, memory
from minipar.model import GPT, cross_entropy
from minipar.parallelize import make_optimizer
from minipar.pipeline.runtime import PipelineExecutor, chunks_for_rank
from minipar.pipeline.schedules import Action
from minipar.precision import MixedPrecision
from minipar.recompute import apply_recompute
from minipar.tensor_parallel import TPGroup, apply_tp, vocab_parallel_cross_entropy


class Profile(NamedTuple):
    """Seconds one rank computes per micro-batch (module docstring), collectives left out: per
    layer, the embeddings (first chunk), ln_f + head + loss (last chunk), and what each action costs
    besides (the loop's or the pipeline executor's own work). With a split backward (zb-h1) _bwd is
    B, _w is W."""
    layer_fwd: float
    layer_bwd: float
    layer_w: float
    emb_fwd: float
    emb_bwd: float
    head_fwd: float
    head_bwd: float
    ends_w: float
    action_fwd: float
    action_bwd: float
    layer_opt: float      # the optimizer step (MixedPrecision.step) on a
                          #   layer's parameters, s a step
    ends_opt: float       # ... on the embeddings', ln_f's and the head's


def _local_tp(t: int, sp: bool):
    """A TPGroup of size t whose collectives do no communication
    (rank 0's shapes, local work only)."""
    ops = comm.Collectives(all_reduce=lambda x, group=None: x,
                           reduce_scatter=lambda x, group=None: torch.tensor_split(x, t)[0].clone(),
                           all_gather=lambda x, group=None: torch.cat([x] * t))

    class LocalTP(TPGroup):
        @property
        def ops(self):
            return ops

    return LocalTP(None, t, 0, sp)


def _model(cfg, t: int, sp: bool, recompute: str, precision: str):
    """(model, loss_fn, MixedPrecision) of one TP rank, collectives local
    (`_local_tp`), as training makes them."""
    torch.manual_seed(0)
    model, loss_fn = GPT(cfg), cross_entropy
    if t > 1:
        tp = _local_tp(t, sp)
        model = apply_tp(model, tp)
        loss_fn = lambda logits, y: vocab_parallel_cross_entropy(logits, y, tp)  # noqa: E731
    apply_recompute(model, recompute)
    return model, loss_fn, MixedPrecision(model, precision)


def _median_ops(step, reps: int) -> dict[str, float]:
    """Median seconds of each op over `reps` calls of step() ->
    {op: seconds}, after two warm-ups."""
    for _ in range(2):
        step()
    runs = [step() for _ in range(reps)]
    return {op: statistics.median(r[op] for r in runs) for op in runs[0]}


def micro_step(cfg, b: int, t: int, sp: bool, recompute: str, precision: str, mode: str):
    """A micro-step of the whole model of cfg as training runs it, returning the seconds of its F,
    B, W and optimizer step (O): "plain" as train's loop (pp = 1), "pipe" / "split" through a
    one-rank PipelineExecutor (B whole, or B and W)."""
    model, loss_fn, mp = _model(cfg, t, sp, recompute, precision)
    meter, x = memory.ActivationMeter(), torch.randint(0, cfg.vocab_size, (b, cfg.seq_len))
    optimizer = make_optimizer(mp.optimized, 1e-3, 0.0)

    def optimize() -> float:
        start = time.perf_counter()
        mp.step(optimizer)
        optimizer.zero_grad()
        return time.perf_counter() - start

    if mode == "plain":
        def step():
            start = time.perf_counter()
            with meter, mp.autocast():
                loss = loss_fn(model(x), x)
            middle = time.perf_counter()
            mp.scale(loss).backward()
            end = time.perf_counter()
            meter.release()
            return {"F": middle - start, "B": end - middle, "W": 0.0, "O": optimize()}
        return step
    plan = [[Action("F", 0, 0),
             Action("B", 0, 0)] + ([Action("W", 0, 0)] if mode == "split" else [])]
    pipe = PipelineExecutor(chunks_for_rank(model, 1, 0), plan, (b, cfg.seq_len, cfg.d_model),
                            loss_fn=loss_fn)

    def step():
        with meter, mp.autocast():
            _, events = pipe.step([x], [x])
        meter.release()
        return {"W": 0.0, **{a.op: end - start for a, start, end in events}, "O": optimize()}
    return step


def _ends(cfg, b: int, t: int, sp: bool, precision: str, reps: int) -> dict[str, float]:
    """Forward and backward seconds of the embeddings alone, and of ln_f + head + loss alone:
    {"emb_F", "emb_B", "head_F", "head_B"}."""
    model, loss_fn, mp = _model(cfg.replace(n_layer=1), t, sp, "none", precision)
    meter, x, positions = memory.ActivationMeter(), torch.randint(0, cfg.vocab_size,
                                                                  (b, cfg.seq_len)), \
        torch.arange(cfg.seq_len)
    hidden = torch.randn(b, cfg.seq_len // (t if sp else 1), cfg.d_model, dtype=mp.dtype,
                         requires_grad=True)

    def part(name, forward, backward):
        def step():
            start = time.perf_counter()
            with meter, mp.autocast():
                y = forward()
            middle = time.perf_counter()
            backward(y)
            end = time.perf_counter()
            meter.release()
            model.zero_grad(set_to_none=True)
            return {name + "_F": middle - start, name + "_B": end - middle}
        return _median_ops(step, reps)

    return {**part("emb", lambda: model.tok_emb(x) + model.pos_emb(positions),
                   lambda y: y.float().sum().backward()),
            **part("head", lambda: loss_fn(model.head(model.ln_f(hidden)), x),
                   lambda y: y.backward())}


@functools.lru_cache(maxsize=512)
def profile(cfg, b: int, t: int, sp: bool, recompute: str, precision: str, threads: int,
            mode: str = "plain",
            reps: int = 15) -> Profile:
    """One rank's compute per micro-batch of `cfg` (module docstring),
    timed here with `threads` threads.
    mode: "plain" (pp = 1), "pipe" (through the pipeline executor),
    "split" (its B and W, for zb-h1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one, three = (_median_ops(micro_step(cfg.replace(n_layer=n), b, t, sp, recompute,
                                             precision, mode), reps)
                      for n in (1, 3))
        ends = _ends(cfg, b, t, sp, precision, reps)
    finally:
        torch.set_num_threads(before)
    layer = {op: max(three[op] - one[op], 0.0) / 2 for op in one}
    rest = {op: max(one[op] - layer[op], 0.0) for op in one}  # the ends and each action's
                                                              #   own overhead
    emb_f, head_f = (min(ends[k], rest["F"]) for k in ("emb_F", "head_F"))
    emb_b, head_b = (min(ends[k], rest["B"]) for k in ("emb_B", "head_B"))
    return Profile(layer["F"], layer["B"], layer["W"], emb_f, emb_b, head_f, head_b, rest["W"],
                   max(rest["F"] - emb_f - head_f, 0.0), max(rest["B"] - emb_b - head_b, 0.0),
                   layer["O"], rest["O"])
