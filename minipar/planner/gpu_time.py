"""The GPU cost model: what one GPU spends on its share of a training step.

`predict.py` composes these pieces into a step time and a memory footprint. Per micro-batch of b
sequences of s tokens, on one GPU of a stage holding its layers split t ways (t = tp), e bytes a
16-bit (2) or fp32 (4) activation, rate = peak_flops * efficiency, the ceiling (fp32 runs as TF32:
half the peak):

  matmuls           each matmul of a layer (`layer_matmuls`: q, k, v, proj, the MLP's) and of the
                    attention core gets its time from its shape (`matmul`): its output cut into
                    128 x 128 tiles, computed a wave of `sms` tiles at a time at the ceiling (tile
                    and wave quantization), bounded below by its bytes at HBM speed (a roofline).
                    So b, t, h, the FFN width and the key/value width all move the efficiency.
                    Backward: each (m, n, k) has an input gradient (m, k, n) and a weight gradient
                    (n, k, m); the FLOPs are Korthikanti et al. 2022 eq. 7's, 72 b s l h^2 (1 +
                    s/(6h) + V/(12 l h)) with the head, for GPT-2's shapes. ZB-H1 (Qi et al. 2023)
                    splits the backward: B the input gradients and the attention core's backward,
                    W the weight gradients (GPT-2: B = (24 b s h^2 + 8 b s^2 h)/t, W = 24 b s h^2/t)
  head              the logits (b s, V/t, h) (the last stage), memory-bound s b V/t (2e + 4)
                    bytes forward (logits written and read, fp32 log-probabilities)
  recompute         selective: the attention core's forward again, 4 b s^2 h / t FLOPs; full: the
                    whole forward of the layer again (matmuls, memory traffic and TP all-reduces)
  memory-bound      bytes / HBM bandwidth. Per layer forward: LayerNorms and residual adds 10 s b h
                    e (/t with SP), the GELU 2 f s b e / t (SwiGLU 5 f: SiLU in and out,
                    the product's inputs and output); materialised attention (Megatron-LM
                    in 2022, not minipar's fused SDPA) 13 a s^2 b / t more: the scores written (2),
                    softmaxed (2 + 2), dropped out (2 + 2 + a 1-byte mask), read by the PV matmul
                    (2). Backward moves twice the forward's bytes (it reads what was saved and the
                    output gradient, writes the input's)
  TP                4 all-reduces of X = b s h e a layer (2 in F, 2 in B; SP's all-gather +
                    reduce-scatter pairs move the same bytes and their re-gather in backward is
                    overlapped, as in Megatron), + 1 for the embedding (F) and 1 for the head (B).
                    Ring: 2(t-1)/t X/bw + 2(t-1) latency
  PP                one message of X (X/t with SP: each rank sends its sequence shard) per boundary
                    per micro-batch each way: X/bw + latency, on the slowest link the pipeline
                    crosses; how it is sent and split is the implementation's (`messages`)
  CP, EP            a context-parallel rank's s / cp tokens and its attention's exchanges, a
                    mixture of experts' matmuls and its all-to-alls: gpu_cp_ep.py
  DP / ZeRO         stage 0: all-reduce of the gradients, bucketed: all but the last bucket overlaps
                    the last micro-batch's backward (data_parallel.py; with a pipeline minipar
                    reduces after the flush: OVERLAPS' grad_reduce_pp); stages 1, 2: reduce-scatter
                    (overlapped the same way; bucketed stage 2 reduces every micro-batch, each
                    but the last hidden under a micro-batch's compute) + all-gather of the updated
                    parameters after the step (exposed in minipar; "production": under the next
                    forward; "deepspeed": nothing under backward, with or without a pipeline, as
                    its defaults run); stage 3: per micro-batch 2 all-gathers + 1 reduce-scatter,
                    prefetched under that micro-batch's compute. What overlaps sticks out where
                    longer than its window and slows the compute under it by SLOWDOWN (`exposed`)
  optimizer         Adam is memory-bound: g + 2 (p + k) bytes a parameter the rank updates, at HBM
                    speed (read the gradient, read and write the weights and the optimizer state)

Memory is not here: it is the same on GPUs and CPUs, memory.py's count (predict.stage_memory).

Links: ranks on one node talk over NVLink (intra_*), else over the node's NICs (inter_*, per GPU:
one NIC each). The grid is minipar's (pp, dp, tp), tp innermost (mesh.py): a TP group spans nodes
when tp > gpus_per_node, a DP group when dp * tp does, a pipeline
when its stages are on different nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from minipar import memory
from minipar.planner.cluster import Cluster, Link
from minipar.planner.gpu_cp_ep import cp_times, ep_time, expert_matmuls
from minipar.planner.links import (  # noqa: F401  (gpu_time.*: the links' collectives)
    SLOWDOWN, all_reduce, all_to_all, exposed, gather_or_scatter, p2p)


# H100 SXM's dense FP8 tensor-core peak is twice its BF16 one (NVIDIA H100 datasheet: 1,979 vs 989
# TFLOP/s): float8 linear layers, where a published run used them (torchtitan's Float8Linear)
FLOAT8_SPEED = 2.0
TILE = 128  # the output tile one SM computes at a time, 128 x 128 (cuBLAS's and CUTLASS's usual)


@dataclass(frozen=True)
class Work:
    """How one GPU runs one micro-batch: its split, its kernels' speeds, its links."""
    b: int
    t: int
    sp: bool
    recompute: str
    e: int                    # bytes an activation element
    rate: float               # matmul FLOP/s of a full wave of tiles: peak * ceiling
    hbm: float                # HBM bytes/s
    tp_link: Link
    split: bool               # the schedule splits the backward into B and W (zb-h1)
    materialized: bool        # attention matrix written to memory (Megatron 2022) or fused (SDPA)
    sms: int = 108            # streaming multiprocessors: tiles computed at once
    tile: int = TILE          # the output tile one of them computes at a time
    overhead: float = 0.0     # seconds a matmul call costs besides (a CPU's dispatch; a GPU's
                              #   launches hide behind the queue of kernels ahead of them)
    cp: int = 1               # context parallelism: this rank holds s / cp tokens of a sequence
    cp_method: str = "ring"
    cp_link: Link | None = None
    ep: int = 1               # expert parallelism: n / ep experts here, tokens sent by all-to-all
    ep_link: Link | None = None
    linear_speed: float = 1.0  # the linear layers' matmuls run this much faster (float8: 2)


def work_on(cluster: Cluster, ranks, par, b: int, attention: str, float8: bool = False) -> Work:
    """How the GPUs `ranks` of `cluster` (a chunk's TP group, or a stage) run a micro-batch of b
    sequences of layout `par`: the slowest one's matmul rate, HBM and SMs, their link. float8: the
    linear layers' matmuls in float8 (torchao's Float8Linear, as torchtitan runs them), at
    FLOAT8_SPEED times the 16-bit rate; attention's stay 16-bit."""
    parts, first = cluster.parts_of(ranks), min(ranks)
    # the CP group: cp ranks tp apart (tp innermost, then cp: mesh.py); the EP group: ep DP ranks
    apart = lambda n, step: cluster.link([first + i * step for i in range(n)])  # noqa: E731
    return Work(b, par.tp, par.sequence_parallel, par.recompute,
                memory.element_bytes(par.precision), cluster.rate(ranks, par.precision),
                min(g.memory_bandwidth for g in parts), cluster.link(ranks),
                par.schedule == "zb-h1", attention == "materialized", min(g.sms for g in parts),
                cp=par.cp, cp_method=par.cp_method, cp_link=apart(par.cp, par.tp),
                ep=par.ep, ep_link=apart(par.ep, par.tp * par.cp),
                linear_speed=FLOAT8_SPEED if float8 else 1.0)


def waves(m: int, n: int, sms: int, batch: int = 1, tile: int = TILE) -> int:
    """Waves of tile x tile output tiles that `batch` (m x n) outputs take on `sms` SMs."""
    return math.ceil(batch * math.ceil(m / tile) * math.ceil(n / tile) / sms)


def ceiling_of(flops_per_s: float, size: int, cluster: Cluster) -> float:
    """The ceiling a measured (size x size) @ (size x size) bf16 matmul at `flops_per_s` implies:
    its rate over the peak, over the fraction of its last wave's tiles that are real."""
    full = waves(size, size, cluster.sms) * cluster.sms
    return flops_per_s / cluster.peak_flops / (math.ceil(size / TILE) ** 2 / full)


def matmul(m: int, n: int, k: int, w: Work, batch: int = 1) -> float:
    """Seconds of `batch` (m x k) @ (k x n) matmuls on one GPU: a roofline of the quantized compute
    and the bytes. The output is cut into w.tile x w.tile tiles (TILE on GPUs), computed `sms` at a
    time: a wave takes 2 tile^2 k / (rate / sms) seconds, however few of its tiles are real (tile
    and wave quantization: a 129-row matmul costs two row tiles, 109 tiles on 108 SMs two waves).
    The bytes, e (m k + k n + m n) a matmul, at HBM speed bound it from below (arithmetic
    intensity: a small matmul waits for memory). The call's own overhead comes on top (0 on GPUs;
    a CPU's, fitted to its measured matmuls: matmul_fit.fit_matmuls, with threads as its SMs)."""
    compute = waves(m, n, w.sms, batch, w.tile) * 2 * w.tile * w.tile * k / (w.rate / w.sms)
    return w.overhead + max(compute, batch * w.e * (m * k + k * n + m * n) / w.hbm)


def layer_matmuls(cfg, b: int, t: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of each matmul of one layer's forward on one of t TP ranks, N = b s tokens (with
    SP too: a column-parallel matmul runs on the gathered sequence): q (N, h/t, h), k and v (N,
    kv/t, h), proj (N, h, h/t); the MLP's fc (and SwiGLU's gate) (N, f/t, h), proj (N, h, f/t), or
    a mixture of experts' router (N, n, h) (its experts: `expert_matmuls`)."""
    n, h, kv, f = b * cfg.seq_len, cfg.d_model, cfg.kv_dim, cfg.ffn_dim
    mlp = [(n, f // t, h)] * (2 if cfg.mlp == "swiglu" else 1) + [(n, h, f // t)]
    attention = [(n, h // t, h), (n, kv // t, h), (n, kv // t, h), (n, h, h // t)]
    return attention + ([(n, cfg.n_expert, h)] if cfg.n_expert else mlp)  # (a MoE's router)


def passes(m: int, n: int, k: int) -> tuple[tuple, tuple, tuple]:
    """A forward matmul (m, n, k) and its backward ones: (m, k, n) for its input's gradient and
    (n, k, m) for its weight's."""
    return (m, n, k), (m, k, n), (n, k, m)


def dense_times(shapes, w: Work, count: int = 1) -> tuple[float, float, float]:
    """(forward, input-gradient B, weight-gradient W) seconds of these matmuls of the linear
    layers (`passes`; each `count` times), at their rate (Work.linear_speed)."""
    if w.linear_speed != 1.0:
        w = dataclasses.replace(w, rate=w.rate * w.linear_speed, linear_speed=1.0)
    return tuple(sum(matmul(*passes(*shape)[i], w, count) for shape in shapes) for i in range(3))


def attention_times(cfg, w: Work) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core on a/t heads: per head and sequence
    (s x hd) q k^T (s, s, hd) and p v (s, hd, s) forward, 4 b s^2 h / t FLOPs; backward dv, dp,
    dq, dk, twice that (the model FLOPs: Korthikanti's count, no mask skipping). With context
    parallelism a rank attends s / cp queries to all s keys (ring, all-gather: 1/cp of the work,
    what the causal balance gives it), or every query on its a / (t cp) heads (Ulysses)."""
    s, hd, heads = cfg.seq_len, cfg.d_model // cfg.n_head, w.b * cfg.n_head // w.t
    rows = s if w.cp_method == "ulysses" else s // w.cp   # CP: queries here, over every key
    heads //= w.cp if w.cp_method == "ulysses" else 1     # (Ulysses: every query, heads / cp)
    scores, mix = matmul(rows, s, hd, w, heads), matmul(rows, hd, s, w, heads)
    return scores + mix, scores + 3 * mix


@functools.lru_cache(maxsize=4096)   # the planner costs the same layer on the same GPUs often
def layer_cost(cfg, w: Work) -> dict[str, dict[str, float]]:
    """Seconds of one transformer layer, {"F"|"B"|"W": {component: s}} (module docstring); cached:
    callers must not modify it. Context parallelism: everything but attention's keys on the s / cp
    tokens held, and `cp_times`; experts: `expert_matmuls`, `ep_time`."""
    mine = cfg.replace(seq_len=cfg.seq_len // w.cp) if w.cp > 1 else cfg
    s, b, h, a, t = mine.seq_len, w.b, cfg.d_model, cfg.n_head, w.t
    fwd_dense, b_dense, w_dense = dense_times(layer_matmuls(mine, b, t), w)
    for shape, count in expert_matmuls(mine, b, w.ep):  # experts: whole on every TP rank
        fwd_e, b_e, w_e = dense_times([shape], w, count)
        fwd_dense, b_dense, w_dense = fwd_dense + fwd_e, b_dense + b_e, w_dense + w_e
    fwd_core, b_core = attention_times(cfg, w)
    act = (5 if cfg.mlp == "swiglu" else 2) * cfg.ffn_dim  # the MLP's elementwise bytes a token
    act = act * cfg.top_k if cfg.n_expert else act / t     # (a token's k experts: TP keeps all)
    traffic = w.e * s * b * (10 * h / (t if w.sp else 1) + act) + (13 * a * s * s * b / t
                                                                   if w.materialized else 0)
    ar = all_reduce(b * s * h * w.e, t, w.tp_link)
    cp_fwd, cp_bwd = cp_times(cfg, w, fwd_core)
    ep = ep_time(mine, w)
    fwd = {"compute": fwd_dense + fwd_core, "memory_bound": traffic / w.hbm, "tp_comm": 2 * ar,
           "cp_comm": cp_fwd, "ep_comm": ep}
    redo = {"none": 0.0,
            "selective": fwd_core + cp_fwd + (13 * a * s * s * b / t / w.hbm if w.materialized
                                              else 0),
            "full": sum(fwd.values())}[w.recompute]
    bwd = {"compute": b_dense + b_core + (0.0 if w.split else w_dense),
           "recompute": redo,
           "memory_bound": 2 * traffic / w.hbm, "tp_comm": 2 * ar, "cp_comm": cp_bwd,
           "ep_comm": ep}
    return {"F": fwd, "B": bwd, "W": {"compute": w_dense} if w.split else {}}


@functools.lru_cache(maxsize=4096)   # (read only, as layer_cost's: chunk_cost adds new dicts)
def ends_cost(cfg, w: Work, first: bool, last: bool) -> dict[str, dict[str, float]]:
    """Seconds of the embedding (first stage: its TP all-reduce and lookups) and the head (last
    stage: final LayerNorm, logits (N, V/t, h), loss; the TP all-reduce before it in backward), on
    the s / cp tokens a context-parallel rank holds."""
    s, b, h, V, t = cfg.seq_len // w.cp, w.b, cfg.d_model, cfg.vocab_size, w.t
    ar = all_reduce(b * s * h * w.e, t, w.tp_link)
    out = {"F": {}, "B": {}, "W": {}}
    if first:
        out["F"] = {"memory_bound": 3 * s * b * h * w.e / w.hbm, "tp_comm": ar}
    if last:
        fwd, grad_in, grad_w = dense_times([(b * s, V // t, h)], w)
        # the logits written and read by the loss (2e), its fp32
        # log-probabilities (4); ln_f's input and output
        traffic = s * b * V / t * (2 * w.e + 4) + 2 * s * b * h * w.e / (t if w.sp else 1)
        out["F"] = _add(out["F"], {"compute": fwd, "memory_bound": traffic / w.hbm})
        out["B"] = {"compute": grad_in + (0.0 if w.split else grad_w),
                    "memory_bound": 2 * traffic / w.hbm,
                    "tp_comm": ar}
        out["W"] = {"compute": grad_w} if w.split else {}
    return out


def chunk_cost(cfg, w: Work, layers: int, first: bool, last: bool) -> dict[str, dict[str, float]]:
    """Seconds of one model chunk (its layers, plus the embedding or the
    head at the ends) per micro-batch."""
    layer, ends = layer_cost(cfg, w), ends_cost(cfg, w, first, last)
    return {op: _add({k: layers * v for k, v in layer[op].items()}, ends[op])
            for op in ("F", "B", "W")}


def _add(x: dict, y: dict) -> dict:
    return {k: x.get(k, 0.0) + y.get(k, 0.0) for k in {**x, **y}}


# What each implementation overlaps and how it sends pipeline messages (TP's collectives are exposed
# in all three: Megatron-LM's --tp-comm-overlap and torchtitan's async TP are not modelled):
#   grad_reduce     gradient buckets launched during the last backward (minipar's GradBuckets, DDP,
#                   Megatron's --overlap-grad-reduce); ZeRO-3's gathers are prefetched in all three
#                   (minipar's Zero3, FSDP, DeepSpeed ZeRO-3). DeepSpeed's engine all-reduces after
#                   backward, and ZeRO-1/2 overlap only with overlap_comm, off by default
#   grad_reduce_pp  DP and ZeRO-1 the same with a pipeline (Megatron); minipar's pipeline runs its
#                   step in no_sync and reduces them after the flush, as DeepSpeed's engine does
#                   (its TrainSchedule issues ReduceGrads after the last step). ZeRO-2 reduces each
#                   micro-batch's as without a pipeline, under grad_reduce (minipar, Megatron)
#   param_gather    ZeRO-1/2's all-gather of the updated weights under the next forward (Megatron's
#                   distributed optimizer with --overlap-param-gather); minipar and DeepSpeed wait
#   p2p_async       pipeline messages travel while both sides compute (isend/irecv: minipar's and
#                   Megatron's runtimes); DeepSpeed's p2p.send/recv block: a stage's step waits for
#                   its two transfers with one neighbour before computing (a forward step sends the
#                   previous gradient and receives the activation, a backward step receives the
#                   gradient and sends the previous activation)
#   p2p_split       without SP each TP rank sends 1/t of a message and the receiver all-gathers it
#                   over the TP link (Megatron's scatter-gather, Narayanan et al. 2021 sec. 4.1;
#                   DeepSpeed's partitioned pipe buffers); minipar's TP ranks each send all of it
OVERLAPS = {"minipar": frozenset({"grad_reduce", "p2p_async"}),
            "production": frozenset({"grad_reduce", "grad_reduce_pp", "param_gather",
                                     "p2p_async", "p2p_split"}),
            "deepspeed": frozenset({"p2p_split"})}
WHOSE = {"minipar": "minipar's", "production": "Megatron-LM's", "deepspeed": "DeepSpeed's"}


def messages(cfg, par, w: Work, link: Link, overlap: str) -> tuple[float, float]:
    """(a pipeline message's seconds between the ops, what each F and B of a chunk adds to its own
    time for each neighbour it exchanges with): per boundary, micro-batch and direction one message
    on `link`; a split one is all-gathered where it arrives; blocking ones (no p2p_async) put both
    transfers with that neighbour inside the op, and nothing between the ops."""
    has = OVERLAPS[overlap]
    x = w.b * cfg.seq_len * cfg.d_model * w.e
    split = w.t > 1 and not w.sp and "p2p_split" in has
    one = p2p(x / (w.t if w.sp or split else 1), link)
    arrive = gather_or_scatter(x, w.t, w.tp_link) if split else 0.0
    return (one, arrive) if "p2p_async" in has else (0.0, arrive + 2 * one)


def dp_time(par, psi: int, per: dict, link: Link, window: float, compute_mb: float,
            units: int, forward_mb: float = 0.0, overlap: str = "minipar",
            experts: tuple = (0, None)) -> float:
    """Exposed seconds of the DP/ZeRO collectives of a stage holding `psi` parameters a GPU;
    `window` is the backward of its last micro-batch (what buckets overlap), `compute_mb` a
    micro-batch's compute, `forward_mb` its forward; `overlap` whose overlaps (OVERLAPS). The DP
    group: dp x cp ranks (context parallelism's are replicas too). experts: (the elements of the
    expert weights among psi, their DP group's link) with expert parallelism: all-reduced over
    dp / ep ranks in buckets of their own, launched after the others, so after backward."""
    n, (mine, expert_link) = par.dp * par.cp, experts
    if mine:
        g = per["grads"]
        return all_reduce(g * mine, n // par.ep, expert_link) + \
            dp_time(par, psi - mine, per, link, window, compute_mb, units, forward_mb, overlap)
    if n == 1:
        return 0.0
    g = per["grads"]  # fp32 gradients under mixed precision unless reduce_fp32=False
    overlapped = ("grad_reduce_pp" if par.pp > 1 and par.zero < 2 else "grad_reduce") \
        in OVERLAPS[overlap]
    if par.zero == 0:
        total = all_reduce(g * psi, n, link)
        if par.dp_mode == "naive" or not overlapped:
            return total
        return _overlap(total, g * psi, par.bucket_mb, window)
    rs = gather_or_scatter(g * psi, n, link)
    ag = gather_or_scatter(per["params"] * psi, n, link)
    if par.zero == 3:  # per micro-batch 2 all-gathers and a reduce-scatter, prefetched
        return par.microbatches * exposed(2 * ag + rs, compute_mb) + ag / max(units, 1)
    if "param_gather" in OVERLAPS[overlap]:  # the new weights gathered under the next forward
        ag = exposed(ag, forward_mb)
    if par.dp_mode == "naive" or not overlapped:  # each reduction waited for: one flat after
        return par.reductions * rs + ag                 #   backward, or bucketed ZeRO-2's each
    # buckets under the last backward; bucketed ZeRO-2 reduces every micro-batch, the ones before
    # the last hidden under the compute that follows them
    earlier = (par.reductions - 1) * exposed(rs, compute_mb)
    return earlier + _overlap(rs, g * psi, par.bucket_mb, window) + ag


def _overlap(total: float, nbytes: float, bucket_mb: float, window: float) -> float:
    """All buckets but the last hide under `window` (as far as it lasts, slowing it: `exposed`);
    the last one is exposed."""
    last = total / max(1, math.ceil(nbytes / (bucket_mb * 2 ** 20)))
    return last + exposed(total - last, window)


def optimizer_time(params_updated: float, per: dict, hbm: float) -> float:
    return params_updated * (per["grads"] + 2 * (per["params"] + per["optimizer"])) / hbm


def fit_efficiency(cfg, layer_step: float, micro_batch: int, tp: int, cluster: Cluster,
                   sequence_parallel: bool = True, materialized: bool = False,
                   precision: str = "bf16") -> float:
    """The ceiling (fraction of peak a full wave of tiles reaches) that makes one layer's forward +
    backward (no recomputation) take `layer_step` seconds under this model: found by bisection,
    since each matmul is the larger of its compute and its bytes.

    Korthikanti Table 4's row with sequence parallelism (22B: a 64, h 6144, s 2048; t = 8, b = 4,
    SP, no recomputation, Megatron's materialised attention, 7.2 + 11.8 ms on A100s) gives the
    A100's ceiling. (Its 7.7 + 11.9 ms row is the one without SP: sequence_parallel=False.)"""
    def step(eff):
        rate = cluster.peak_flops * eff * (0.5 if precision == "fp32" else 1.0)
        w = Work(micro_batch, tp, sequence_parallel, "none", memory.element_bytes(precision), rate,
                 cluster.memory_bandwidth, cluster.link(range(tp)), False, materialized,
                 cluster.sms)
        return sum(v for op in layer_cost(cfg, w).values() for v in op.values())
    lo, hi = 1e-3, 1.0
    if step(hi) > layer_step:
        raise ValueError(f"{layer_step} s is faster than this model allows at the peak")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if step(mid) <= layer_step else (mid, hi)
    return hi
