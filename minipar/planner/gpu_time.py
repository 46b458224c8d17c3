"""The GPU cost model: what one GPU spends on its share of a training step.

`predict.py` composes these pieces into a step time and a memory footprint. Per micro-batch of b
sequences of s tokens, on one GPU of a stage holding its layers split t ways (t = tp), e bytes a
16-bit (2) or fp32 (4) activation, rate = peak_flops * efficiency
(fp32 runs as TF32: half the peak):

  matmuls, a layer  F = (24 b s h^2 + 4 b s^2 h) / t FLOPs, backward 2F: the model FLOPs of
                    Korthikanti et al. 2022 eq. 7, 72 b s l h^2 (1 + s/(6h) + V/(12 l h)) with the
                    head, over 3. ZB-H1 splits the backward (Qi et al. 2023):
                    B = (24 b s h^2 + 8 b s^2 h)/t, W = 24 b s h^2/t
  head              F = 2 b s h V / t (the logits, last stage), backward 4 b s h V / t; memory-bound
                    s b V/t (2e + 4) bytes forward (logits written and read, fp32 log-probabilities)
  recompute         selective: the attention core's forward again, 4 b s^2 h / t FLOPs; full: the
                    whole forward of the layer again (matmuls, memory traffic and TP all-reduces)
  memory-bound      bytes / HBM bandwidth. Per layer forward: LayerNorms and residual adds 10 s b h
                    e (/t with SP), the GELU 8 s b h e / t; materialised attention (Megatron-LM in
                    2022, not minipar's fused SDPA) 13 a s^2 b / t more: the scores written (2),
                    softmaxed (2 + 2), dropped out (2 + 2 + a 1-byte mask), read by the PV matmul
                    (2). Backward moves twice the forward's bytes (it reads what was saved and the
                    output gradient, writes the input's)
  TP                4 all-reduces of X = b s h e a layer (2 in F, 2 in B; SP's all-gather +
                    reduce-scatter pairs move the same bytes and their re-gather in backward is
                    overlapped, as in Megatron), + 1 for the embedding (F) and 1 for the head (B).
                    Ring: 2(t-1)/t X/bw + 2(t-1) latency
  PP                one message of X (X/t with SP: each rank sends its sequence shard) per boundary
                    per micro-batch each way: X/bw + latency, on the
                    slowest link the pipeline crosses
  DP / ZeRO         stage 0: all-reduce of the gradients, bucketed: all but the last bucket overlaps
                    the last micro-batch's backward (data_parallel.py); stages 1, 2: reduce-scatter
                    (overlapped the same way; bucketed stage 2 reduces every micro-batch, each
                    but the last exposed only where longer than a micro-batch's compute) +
                    all-gather of the updated parameters after the step (exposed); stage 3:
                    per micro-batch 2 all-gathers + 1 reduce-scatter, prefetched under that
                    micro-batch's compute, exposed where longer than it
  optimizer         Adam is memory-bound: g + 2 (p + k) bytes a parameter the rank updates, at HBM
                    speed (read the gradient, read and write the weights and the optimizer state)

Memory is not here: it is the same on GPUs and CPUs, memory.py's count (predict.stage_memory).

Links: ranks on one node talk over NVLink (intra_*), else over the node's NICs (inter_*, per GPU:
one NIC each). The grid is minipar's (pp, dp, tp), tp innermost (mesh.py): a TP group spans nodes
when tp > gpus_per_node, a DP group when dp * tp does, a pipeline
when its stages are on different nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minipar import memory
from minipar.planner.cluster import Cluster, Link


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes`: 2(n-1)/n of it sent by each rank, 2(n-1) steps."""
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def gather_or_scatter(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather or reduce-scatter whose full tensor is `nbytes`: (n-1)/n of it, n-1 steps."""
    return 0.0 if n == 1 else (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def p2p(nbytes: float, link: Link) -> float:
    return nbytes / link.bandwidth + link.latency


@dataclass(frozen=True)
class Work:
    """How one GPU runs one micro-batch: its split, its kernels' speeds, its links."""
    b: int
    t: int
    sp: bool
    recompute: str
    e: int                    # bytes an activation element
    rate: float               # matmul FLOP/s
    hbm: float                # HBM bytes/s
    tp_link: Link
    split: bool               # the schedule splits the backward into B and W (zb-h1)
    materialized: bool        # attention matrix written to memory (Megatron 2022) or fused (SDPA)


def layer_cost(cfg, w: Work) -> dict[str, dict[str, float]]:
    """Seconds of one transformer layer, {"F"|"B"|"W": {component: s}} (module docstring)."""
    s, b, h, a, t = cfg.seq_len, w.b, cfg.d_model, cfg.n_head, w.t
    dense, core = 24 * b * s * h * h / t, 4 * b * s * s * h / t
    traffic = w.e * s * b * h * (10 / (t if w.sp else 1) + 8 / t) + (13 * a * s * s * b / t
                                                                     if w.materialized else 0)
    ar = all_reduce(b * s * h * w.e, t, w.tp_link)
    fwd = {"compute": (dense + core) / w.rate, "memory_bound": traffic / w.hbm, "tp_comm": 2 * ar}
    redo = {"none": 0.0,
            "selective": core / w.rate + (13 * a * s * s * b / t / w.hbm if w.materialized else 0),
            "full": sum(fwd.values())}[w.recompute]
    bwd = {"compute": (dense + 2 * core if w.split else 2 * dense + 2 * core) / w.rate,
           "recompute": redo,
           "memory_bound": 2 * traffic / w.hbm, "tp_comm": 2 * ar}
    return {"F": fwd, "B": bwd, "W": {"compute": dense / w.rate} if w.split else {}}


def ends_cost(cfg, w: Work, first: bool, last: bool) -> dict[str, dict[str, float]]:
    """Seconds of the embedding (first stage: its TP all-reduce and lookups) and the head (last
    stage: final LayerNorm, logits, loss; the TP all-reduce before it in backward)."""
    s, b, h, V, t = cfg.seq_len, w.b, cfg.d_model, cfg.vocab_size, w.t
    ar = all_reduce(b * s * h * w.e, t, w.tp_link)
    out = {"F": {}, "B": {}, "W": {}}
    if first:
        out["F"] = {"memory_bound": 3 * s * b * h * w.e / w.hbm, "tp_comm": ar}
    if last:
        logits = 2 * b * s * h * V / t
        # the logits written and read by the loss (2e), its fp32
        # log-probabilities (4); ln_f's input and output
        traffic = s * b * V / t * (2 * w.e + 4) + 2 * s * b * h * w.e / (t if w.sp else 1)
        out["F"] = _add(out["F"], {"compute": logits / w.rate, "memory_bound": traffic / w.hbm})
        out["B"] = {"compute": (1 if w.split else 2) * logits / w.rate,
                    "memory_bound": 2 * traffic / w.hbm,
                    "tp_comm": ar}
        out["W"] = {"compute": logits / w.rate} if w.split else {}
    return out


def chunk_cost(cfg, w: Work, layers: int, first: bool, last: bool) -> dict[str, dict[str, float]]:
    """Seconds of one model chunk (its layers, plus the embedding or the
    head at the ends) per micro-batch."""
    layer, ends = layer_cost(cfg, w), ends_cost(cfg, w, first, last)
    return {op: _add({k: layers * v for k, v in layer[op].items()}, ends[op])
            for op in ("F", "B", "W")}


def _add(x: dict, y: dict) -> dict:
    return {k: x.get(k, 0.0) + y.get(k, 0.0) for k in {**x, **y}}


def dp_time(par, psi: int, per: dict, link: Link, window: float, compute_mb: float,
            units: int) -> float:
    """Exposed seconds of the DP/ZeRO collectives of a stage holding `psi` parameters a GPU;
    `window` is the backward of its last micro-batch (what buckets overlap), `compute_mb` a
    micro-batch's compute."""
    n = par.dp
    if n == 1:
        return 0.0
    g = per["grads"]  # fp32 gradients under mixed precision unless reduce_fp32=False
    if par.zero == 0:
        total = all_reduce(g * psi, n, link)
        return total if par.dp_mode == "naive" else _overlap(total, g * psi, par.bucket_mb, window)
    rs = gather_or_scatter(g * psi, n, link)
    ag = gather_or_scatter(per["params"] * psi, n, link)
    if par.zero in (1, 2) and par.dp_mode == "naive":  # one flat reduce-scatter after backward
        return rs + ag
    if par.zero in (1, 2):  # buckets under the last backward; bucketed ZeRO-2 reduces every
        # micro-batch, the ones before the last hidden under the compute that follows them
        earlier = (par.reductions - 1) * max(0.0, rs - compute_mb)
        return earlier + _overlap(rs, g * psi, par.bucket_mb, window) + ag
    per_mb = 2 * ag + rs
    return par.microbatches * max(0.0, per_mb - compute_mb) + ag / max(units, 1)


def _overlap(total: float, nbytes: float, bucket_mb: float, window: float) -> float:
    """All buckets but the last hide under `window` (as far as it
    lasts); the last one is exposed."""
    last = total / max(1, math.ceil(nbytes / (bucket_mb * 2 ** 20)))
    return last + max(0.0, total - last - window)


def optimizer_time(params_updated: float, per: dict, hbm: float) -> float:
    return params_updated * (per["grads"] + 2 * (per["params"] + per["optimizer"])) / hbm


def fit_efficiency(cfg, layer_step: float, micro_batch: int, tp: int, cluster: Cluster,
                   sequence_parallel: bool = True, materialized: bool = False,
                   precision: str = "bf16") -> float:
    """The efficiency that makes one layer's forward + backward (no recomputation) take `layer_step`
    seconds: the matmul FLOPs over the time left once this model's
    TP and memory-bound time are taken off.

    Korthikanti Table 4's row with sequence parallelism (22B: a 64, h 6144, s 2048; t = 8, b = 4,
    SP, no recomputation, Megatron's materialised attention, 7.2 + 11.8 ms on A100s) gives the
    A100's 0.72. (Its 7.7 + 11.9 ms row is the one without SP: sequence_parallel=False.)"""
    ranks = range(tp)
    w = Work(micro_batch, tp, sequence_parallel, "none", memory.element_bytes(precision), 1.0,
             cluster.memory_bandwidth, cluster.link(ranks), False, materialized)
    cost = layer_cost(cfg, w)
    flops = cost["F"]["compute"] + cost["B"]["compute"]  # FLOPs, since the rate was 1
    other = sum(v for op in cost.values() for k, v in op.items() if k != "compute")
    return flops / (layer_step - other) / (cluster.peak_flops * (0.5 if precision == "fp32"
                                                                 else 1.0))
