"""Bytes each rank sends per step, predicted from the configuration, named as `comm.CommStats`
records them: what the tests assert the measured counts equal, and the lessons print beside them.

    dp(cfg, par)                    data parallelism and ZeRO over the DP group (data_parallel.py,
                                    zero.py): the all-reduce, or reduce-scatter + all-gather
    tp(cfg, par, global_batch)      tensor parallelism within the TP group (tensor_parallel.py):
                                    f and g of every layer, the embedding, the head and the loss
The formulas are the techniques' own (their module docstrings state them; docs/references.md,
"Communication", sources them).
"""
from __future__ import annotations

from minipar.data_parallel import split
from minipar.memory import (chunk_params, chunk_units, element_bytes, flat_shard, layout_bytes,
                            replicated_params)


def dp(cfg, par, bytes_per_param: dict | None = None) -> dict[str, float]:
    """Bytes one rank sends per step, {collective: bytes}, as a `comm.CommStats` names them:

      stage 0 (dp > 1)  all_reduce      2(N-1)/N g Psi   (ring; uneven chunks move it a few bytes)
      stages 1, 2       reduce_scatter  (N-1)/N g Psi_pad   +  all_gather  (N-1)/N p Psi_pad
      stage 3           reduce_scatter  (N-1)/N g Psi_pad   +  all_gather  2 (N-1)/N p Psi_pad
                        (gathered before forward and again before backward: 3 Psi in all, 1.5x DP),
                        times par.microbatches: every micro-batch gathers and reduces again;
                        bucketed stage 2 reduce-scatters every micro-batch too, and pads each
                        bucket (data_parallel.split) on its own
    Psi is what one rank holds (`tp_params`); `tp` adds the TP group's bytes.
    With par.collectives == "torch" the names get a "torch_" prefix. Nothing is sent when N = 1.
    """
    per = bytes_per_param or layout_bytes(par.precision, par.reduce_fp32)
    n, units = par.dp, chunk_units(cfg, par.tp, cfg.n_layer, True, True)
    if n == 1:
        return {}
    psi = sum(units)
    flats = units if par.zero == 3 else [psi]
    if par.zero in (1, 2) and par.dp_mode == "bucketed":  # each bucket padded on its own
        sizes = chunk_params(cfg, par.tp, cfg.n_layer, True, True)
        flats = [sum(sizes[i] for i in b)
                 for b in split(sizes, par.bucket_bytes, per["grads"])]
    shard = sum(flat_shard(size, n, 0)[0] for size in flats)
    if par.zero == 0:
        sent = {"all_reduce": 2 * (n - 1) / n * per["grads"] * psi}
    else:
        times = par.reductions  # ZeRO-3 gathers every micro-batch too
        sent = {"reduce_scatter": times * (n - 1) * shard * per["grads"],
                "all_gather": (times if par.zero == 3 else 1) * (2 if par.zero == 3 else 1)
                * (n - 1) * shard * per["params"]}
    prefix = "torch_" if par.collectives == "torch" else ""
    return {prefix + k: v for k, v in sent.items()}


def tp(cfg, par, global_batch: int, dp_rank: int = 0) -> dict[str, float]:
    """Bytes one rank (of DP rank `dp_rank`: its b with par.dp_shares) sends to its TP group per
    step, {collective: bytes}, as a `comm.CommStats` names them.

    A micro-batch of b s tokens, X = b s h e bytes (e = 4 in fp32, 2 in 16-bit), t ranks, l layers:
      no SP  all_reduce      (4 l + 2) 2(t-1)/t X            the layers' f and g, embedding, head
                           + 2 * 2(t-1)/t * 4 b s            the loss: sum of exp, target logit
             all_gather      (t-1) 4 b s                     the loss: every rank's maxima
      SP     reduce_scatter  (4 l + 2) (t-1)/t X
             all_gather      (6 l + 3) (t-1)/t X + (t-1) 4 b s     the extra 2 l + 1: inputs
                                                                   gathered again in backward
             all_reduce      the loss's, as above, + once a step 2(t-1)/t g (6 l h + s h + 2 h),
                             the partial gradients (g bytes a gradient element;
                             memory.replicated_params for other shapes)
    times par.microbatches. Full recomputation (recompute.py) runs each layer's forward again in
    backward, as far as the backward needs it: up to the attention's g, so + l all-reduces of X (SP:
    + l reduce-scatters and + 2 l all-gathers, its two column-parallel inputs). Nothing is sent
    when t = 1.
    """
    t, l = par.tp, cfg.n_layer
    if t == 1:
        return {}
    b = par.dp_rows(global_batch)[dp_rank] // par.microbatches
    e = element_bytes(par.precision)
    x, stats, ring = b * cfg.seq_len * cfg.d_model * e, 4 * b * cfg.seq_len, (t - 1) / t
    m, again = par.microbatches, l * (par.recompute == "full")  # the layers' recomputed forwards
    if par.sequence_parallel:
        partial = replicated_params(cfg, l, True, True)
        sent = {"reduce_scatter": m * (4 * l + 2 + again) * ring * x,
                "all_gather": m * ((6 * l + 3 + 2 * again) * ring * x + (t - 1) * stats),
                "all_reduce": m * 2 * 2 * ring * stats
                + 2 * ring * partial * layout_bytes(par.precision, par.reduce_fp32)["grads"]}
    else:
        sent = {"all_reduce": m * ((4 * l + 2 + again) * 2 * ring * x + 2 * 2 * ring * stats),
                "all_gather": m * (t - 1) * stats}
    return {("torch_" if par.collectives == "torch" else "") + k: v for k, v in sent.items()}
