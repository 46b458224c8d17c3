"""Activations predicted: the bytes minipar's GPT saves for backward on one micro-batch, by part
(`activations`), for the mixture-of-experts layer (`moe_activations`) and context-parallel
attention (`cp_extra`), the loss (`loss_bytes`), and Korthikanti et al.'s count they are adjusted
from (`korthikanti`). Pure formulas of the configuration; memory.py puts them together per rank
(pipelines: their schedules) and minipar.activations measures what they predict.
"""
from __future__ import annotations

import math


def korthikanti(cfg, micro_batch: int, element_bytes: int = 2, t: int = 1,
                sp: bool = False) -> float:
    """The paper's activations for the l layers, bytes (Table 2, no recomputation), 16-bit:

        no parallelism  sbh (34 + 5as/h)
        TP              sbh (10 + 24/t + 5as/(ht))
        TP+SP           sbh (34/t + 5as/(ht))

    Of the 34 sbh, 10 lie outside the tensor-parallel regions (replicated by TP, cut by SP): 8 of
    16-bit values (LayerNorm inputs, the regions' inputs) and 2 dropout masks of 1 byte an element;
    24 are inside (q, k, v, the attention output, the MLP's 4h activations). Of the 5as^2b, as^2b is
    the attention's dropout mask and 4 are 16-bit (softmax and dropout outputs). `element_bytes`
    rescales the values, not the masks."""
    s, b, h, a = cfg.seq_len, micro_batch, cfg.d_model, cfg.n_head
    e = element_bytes / 2
    outside = (8 * e + 2) / (t if sp else 1)
    return cfg.n_layer * (s * b * h * (outside + 24 * e / t) + a * s * s * b * (4 * e + 1) / t)


def activations(cfg, micro_batch: int, element_bytes: int = 4, t: int = 1, sp: bool = False,
                recompute: str = "none", cp: tuple | None = None) -> dict[str, int]:
    """Bytes minipar's GPT saves for backward on one micro-batch of b sequences, by part, over t
    tensor-parallel ranks (sequence-parallel if sp), recomputing as `recompute` says (recompute.py):
    "full" keeps only each layer's input, s b h e (/t with SP); "selective" drops the 4 asb/t below.

    Per layer, e bytes an element (4 in fp32, 2 for a 16-bit model):
        outside the TP regions (/t with SP):
          4 sbh e    inputs of ln1 and ln2, their outputs (the regions' inputs)
          4 sb e     mean and 1/std of the two LayerNorms
        inside (/t):
          (2 h + 2 k) sb e   q, k, v (k = kv_dim each), the attention output
          2 f sb e   gelu: the GELU's input and output (f = ffn_dim)
          4 f sb e   swiglu: the gate's output, its SiLU, the up projection, their product
          4 asb      the attention's log-sum-exp, fp32
        (GPT-2, k = h, f = 4 h: 12 sbh e inside)
        a mixture of experts in place of the MLP: `moe_activations`, on every TP rank whole
    That is Korthikanti's count less what minipar does not store: the two dropout masks (2 sbh:
    dropout is off) and the attention matrix (5as^2b: F.scaled_dot_product_attention's fused kernel
    keeps only the log-sum-exp and recomputes the probabilities in backward).
    Outside the layers:
        head     2 sbh e + 2 sb e  (ln_f's input, output and statistics; /t with SP)
                 + 4 sbV + 4        (t = 1: F.cross_entropy's fp32 log-probabilities, its
                                     weight sum)
                 + 4 sbV/t + 9 sb   (t > 1: the vocab-parallel softmax slice, local targets,
                                     their mask)
        tokens   16 sb + 8 s        (t = 1: int64 input ids and targets, positions)
                 9 sb + 8 s         (t > 1: the embedding's local ids and mask, positions)
    Context parallelism, cp = (method, s_r): the rank holds s_r of each sequence's s tokens, and
    everything above counts s_r for s; its attention keeps besides, a layer, unless recomputed
    (`cp_extra`).
    """
    T = cfg.seq_len
    s, b, h, a, V = cp[1] if cp else T, micro_batch, cfg.d_model, cfg.n_head, cfg.vocab_size
    e, cut = element_bytes, t if sp else 1
    loss, tokens = (4 * s * b * V + 4, 16 * s * b) if t == 1 else (4 * s * b * V // t + 9 * s * b,
                                                                   9 * s * b)
    mlp = 0 if cfg.n_expert else (4 if cfg.mlp == "swiglu" else 2) * cfg.ffn_dim
    outside = 4 * s * b * h * e + 4 * s * b * e
    inside = (2 * h + 2 * cfg.kv_dim + mlp) * s * b * e + 4 * a * s * b
    experts = moe_activations(cfg.replace(seq_len=s), b, e) if cfg.n_expert else 0
    extra = cp_extra(cfg, b, e, t, *cp) if cp else 0
    layer = {"none": outside // cut + inside // t + experts + extra,
             "selective": outside // cut + (inside - 4 * a * s * b) // t + experts,
             "full": s * b * h * e // cut}[recompute]
    return {"layers": cfg.n_layer * layer,
            "head": (2 * s * b * h * e + 2 * s * b * e) // cut + loss,
            "tokens": tokens + 8 * s}


def moe_activations(cfg, b: int, e: int, rows: int | None = None) -> int:
    """Bytes a mixture-of-experts layer (moe.py) saves for b sequences of s tokens, T = s b tokens
    to n experts, k each, with S token-slots kept (T k dropless; with capacity_factor, at most
    b n C: C an expert's capacity a sequence, reached when every expert fills) and R rows through
    this rank's experts (`rows`; default S, as on one device; with expert parallelism the rows
    that arrive, S when the routing is even):
        router   4 T n (the softmax's scores) + 8 T k (the chosen ids) + 4 T k + 4 T (the gates
                 and their sum, fp32) + T k (kept, bool) + 4 b n (each sequence's f, fp32)
        slots    16 S (two int64 orders) + S e (the gates in the model's dtype) + 2 S h e (the
                 experts' outputs back home, weighted)
        experts  R (h + 2 f) e, gelu: the rows, fc's output, the GELU's
                 R (h + 4 f) e, swiglu: the rows, the gate's output, its SiLU, fc's, the product
    """
    n, k, h, f, T = cfg.n_expert, cfg.top_k, cfg.d_model, cfg.ffn_dim, cfg.seq_len * b
    slots = T * k
    if cfg.capacity_factor is not None:
        slots = min(slots, b * n * math.ceil(cfg.capacity_factor * cfg.seq_len * k / n))
    rows = slots if rows is None else rows
    router = 4 * T * n + 12 * T * k + 4 * T + T * k + 4 * b * n
    width = h + (4 if cfg.mlp == "swiglu" else 2) * f
    return router + 16 * slots + slots * e + 2 * slots * h * e + rows * width * e


def cp_extra(cfg, b: int, e: int, t: int, method: str, s_r: int) -> int:
    """Bytes a layer's context-parallel attention (context_parallel.py) keeps beyond the one-device
    attention's at s_r tokens, for b sequences of s tokens, on one of t TP ranks (k = kv_dim):
        ring        0: its blocks pass through, and it saves q, k, v, out and lse as one device does
        all-gather  2 b (s - s_r) k e / t (every rank's keys and values, gathered) + s_r s e (the
                    causal mask, made an additive one of the model's dtype) + 8 s (the gathered
                    rows' index)
        ulysses     b s_r h e / t (the attention's output before the all-to-all takes it home) +
                    16 s (the two int64 orders, by position and back)"""
    s = cfg.seq_len
    if method == "all-gather":
        return 2 * b * (s - s_r) * cfg.kv_dim * e // t + s_r * s * e + 8 * s
    if method == "ulysses":
        return b * s_r * cfg.d_model * e // t + 16 * s
    return 0


def loss_bytes(cfg, b: int, t: int, e: int) -> tuple[int, int]:
    """(bytes the loss saves for b sequences, those that outlive its backward node): t = 1,
    F.cross_entropy's fp32 log-probabilities, weight sum and int64 targets; t > 1, the vocab-
    parallel fp32 softmax shard (returned in place as the logits' gradient, alive to the head's
    node unless 16-bit logits, e = 2, cast it back first), the local targets and their mask."""
    sb, V = cfg.seq_len * b, cfg.vocab_size
    shard = 4 * sb * V // t
    return (4 * sb * V + 4 + 8 * sb, 0) if t == 1 else (shard + 9 * sb, shard * (e == 4))
