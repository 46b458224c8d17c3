"""Megatron tensor parallelism: every layer's matrices split over the t ranks of a TP group.

Shoeybi et al. 2019 (Megatron-LM). In the MLP, Y = GeLU(X A) B: cut A by columns and B by rows,

    A = [A_1 | ... | A_t]      B = [B_1; ...; B_t]      rank r computes  Y_r = GeLU(X A_r) B_r,

and Y = sum_r Y_r: the GeLU needs no communication, the sum is one all-reduce. Attention cuts the
same way along its heads: q, k, v column-parallel (rank r holds heads r a/t ... (r+1) a/t - 1), the
output projection row-parallel. Two conjugate operators mark where the ranks meet:

    f  identity forward, all-reduce backward   (entering a region: each rank's input gradient
                                               is a part)
    g  all-reduce forward, identity backward   (leaving it: each rank's output is a part)

The token embedding is cut by vocabulary rows (each rank looks up the ids it owns, zeros elsewhere,
g sums), the head by vocabulary columns, and the cross-entropy works on those logit slices: the max
and the sum of exponentials are reduced across the group, so the
full logits never exist on any rank.

Sequence parallelism (Korthikanti et al. 2022) cuts what lies outside the regions, LayerNorms and
the residual stream, along the sequence. f becomes an all-gather along the sequence (backward: a
reduce-scatter) and g a reduce-scatter (backward: an all-gather): the same bytes, since an
all-reduce is a reduce-scatter plus an all-gather. A column-parallel matmul keeps its input as the
sequence shard and gathers it again in backward (sec. 4.2.2). Parameters used on a shard
(LayerNorms, the row-parallel biases, the positions) get partial gradients,
summed over the group after backward.

Per rank, t ranks, l layers, h hidden, a heads, V vocabulary, b
s tokens per micro-batch, e bytes each:
    parameters   (12 l h^2 + 6 l h + 2 V h + V) / t  +  6 l h + s h + 2 h      (`memory.tp_params`)
    forward      2 l + 1 all-reduces of b s h e (2 a layer, 1 after the embedding)
    backward     2 l + 1 all-reduces of b s h e (2 a layer, 1 before the head)
                 each sends 2 (t-1)/t of its size: 8 b s h e (t-1)/t a layer, forward + backward
    loss         2 all-reduces and 1 all-gather of b s fp32 values (sum of exp, target logit; max)
    with SP      each all-reduce above an all-gather + reduce-scatter pair of the same bytes;
                 backward gathers each column-parallel input again (2 l + 1 more all-gathers: bytes
                 for memory); once a step an all-reduce of the 6 l h + s h + 2 h partial gradients
                 (`traffic.tp` adds them up)
    activations  a layer (Korthikanti Table 2, 16-bit): s b h (10 + 24/t + 5 a s/(h t)); SP: s b h
                 (34/t + 5 a s/(h t))
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from minipar import comm
from minipar.config import tp_sizes
from minipar.model import GPT, MLP, CausalSelfAttention


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group as a value: who, how many, and how its regions communicate."""
    group: object                     # the process group of the t ranks (None: the world)
    size: int                         # t
    rank: int                         # this rank's place in the group
    sequence_parallel: bool = False   # shard LayerNorms and the residual stream along the sequence
    collectives: str = "minipar"      # "minipar" (comm.py's ring) or "torch" (the backend's)
    stats: comm.CommStats | None = field(default=None, compare=False)  # counts what the group sends
    scratch: comm.Scratch = field(default_factory=comm.Scratch, compare=False, repr=False)  # ring's

    @classmethod
    def of(cls, group, sequence_parallel: bool = False, collectives: str = "minipar",
           stats: comm.CommStats | None = None) -> "TPGroup":
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return cls(group, size, rank, sequence_parallel, collectives, stats)

    @property
    def ops(self) -> comm.Collectives:
        """The group's all-reduce, reduce-scatter and all-gather, counted in `stats`."""
        return comm.implementation(self.collectives, self.stats, self.scratch)

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        """Leave a parallel region: g (all-reduce), or with SP a
        reduce-scatter along the sequence."""
        if self.sequence_parallel:
            return _ReduceScatterSequence.apply(y, self)
        return _ReduceFromTP.apply(y, self)


# -----------------------------------------------------------------------------
# the conjugate operators


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.ops.all_reduce(grad.contiguous(), ctx.tp.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (in place: the row-parallel matmul's output
    is not kept), identity backward."""

    @staticmethod
    def forward(ctx, y, tp):
        ctx.mark_dirty(y)
        return tp.ops.all_reduce(y, tp.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    """(B, T, h) <-> (T, B, h), contiguous: the collectives cut and join along dim 0."""
    return x.transpose(0, 1).contiguous()


def _gather_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _seq_first(tp.ops.all_gather(_seq_first(x), tp.group))       # (B, T/t, h) -> (B, T, h)


def _scatter_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    # (B, T, h) summed -> (B, T/t, h)
    return _seq_first(tp.ops.reduce_scatter(_seq_first(x), tp.group))


class _ReduceScatterSequence(torch.autograd.Function):
    """g with SP: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, y, tp):
        ctx.tp = tp
        return _scatter_sequence(y, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.tp), None


class _GatherThenLinears(torch.autograd.Function):
    """f with SP, fused with the column-parallel matmuls that share its input: all-gather the
    sequence, multiply by each weight. Backward gathers the shard again rather than keep the
    full-sequence input, and reduce-scatters the input gradient (the sum over the matmuls) once."""

    @staticmethod
    def forward(ctx, x, tp, *weights_and_biases):
        ctx.tp = tp
        ctx.save_for_backward(x, *weights_and_biases)
        full = _gather_sequence(x, tp)
        pairs = zip(weights_and_biases[::2], weights_and_biases[1::2])
        return tuple(F.linear(full, w, b) for w, b in pairs)

    @staticmethod
    def backward(ctx, *grads):
        x, *params = ctx.saved_tensors
        weights, biases = params[::2], params[1::2]
        full = _gather_sequence(x, ctx.tp).to(grads[0].dtype).flatten(0, 1)     # (B T, h)
        grad_full = sum(g @ w.to(g.dtype) for g, w in zip(grads, weights))      # (B, T, h)
        out = [_scatter_sequence(grad_full, ctx.tp).to(x.dtype), None]
        for g, w, b in zip(grads, weights, biases):
            g = g.flatten(0, 1)                                                 # (B T, out/t)
            out += [(g.t() @ full).to(w.dtype), None if b is None else g.sum(0).to(b.dtype)]
        return tuple(out)


def column_parallel(x: torch.Tensor, linears: list, tp: TPGroup) -> list[torch.Tensor]:
    """Enter a region and apply the column-parallel `linears` to its
    one input: f, then the matmuls."""
    if tp.sequence_parallel:
        return list(_GatherThenLinears.apply(x, tp,
                                             *(t for lin in linears
                                               for t in (lin.weight, lin.bias))))
    x = _CopyToTP.apply(x, tp)
    return [F.linear(x, lin.weight, lin.bias) for lin in linears]


# ----------------------------------------------------------------------------- the parallel layers


def _shard(param: torch.Tensor | None, dim: int, tp: TPGroup) -> nn.Parameter | None:
    """This rank's block of a full parameter, cut along `dim` (Megatron's
    `partition_dim` attribute)."""
    if param is None:
        return None
    # as checkpoint.block_of cuts
    block = nn.Parameter(param.detach().tensor_split(tp.size, dim)[tp.rank].clone())
    block.tp_dim = dim
    return block


def _replicated(param: nn.Parameter | None, tp: TPGroup) -> nn.Parameter | None:
    """A parameter every rank holds whole; with SP, each uses it on
    its shard: its gradient is partial."""
    if param is not None:
        param.sequence_partial = tp.sequence_parallel
    return param


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r + b_r: rank r holds a block of the output features (rows of nn.Linear's weight).

        weight (out, in)   rank 0  [=========]   out/t rows
                           rank 1  [=========]
                            ...
    The input is whole on every rank (with SP, a sequence shard to gather); the output is rank r's
    features, out/t of them. Built from the full nn.Linear, so every t cuts the same matrix.
    """

    def __init__(self, linear: nn.Linear, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight, self.bias = _shard(linear.weight, 0, tp), _shard(linear.bias, 0, tp)

    def forward(self, x):
        return column_parallel(x, [self], self.tp)[0]


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r B_r + b: rank r holds a block of the input features (columns of the weight).

        weight (out, in)   rank 0   rank 1   ...
                           [ ||| ]  [ ||| ]       in/t columns each
    The input is rank r's features (a column-parallel output); the output is summed over the group
    by g (with SP, reduce-scattered along the sequence), then the bias is added once.
    """

    def __init__(self, linear: nn.Linear, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight, self.bias = _shard(linear.weight, 1, tp), _replicated(linear.bias, tp)

    def forward(self, x):
        y = self.tp.exit(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ParallelAttention(nn.Module):
    """Causal self-attention on a/t query heads and n_kv/t key/value heads: q, k, v column-parallel
    (one f for the three), proj row-parallel. Query heads share a key/value head in contiguous
    groups, so rank r's query heads use exactly rank r's key/value heads."""

    def __init__(self, attn: CausalSelfAttention, tp: TPGroup):
        super().__init__()
        self.tp, self.dropout = tp, attn.dropout
        self.n_head, self.n_kv_head = attn.n_head // tp.size, attn.n_kv_head // tp.size
        self.q, self.k, self.v = (ColumnParallelLinear(lin, tp) for lin in (attn.q, attn.k, attn.v))
        self.proj = RowParallelLinear(attn.proj, tp)

    # (B, T, h) or (B, T/t, h) with SP
    def forward(self, x):
        q, k, v = (rearrange(y, "b t (nh hd) -> b nh t hd", nh=heads) for y, heads in
                   zip(column_parallel(x, [self.q, self.k, self.v], self.tp),
                       (self.n_head, self.n_kv_head, self.n_kv_head)))
        # like the input
        return self.proj(rearrange(self.core(q, k, v), "b nh t hd -> b t (nh hd)"))

    core = CausalSelfAttention.core  # the single-device attention, on this rank's heads


class ParallelMLP(nn.Module):
    """The MLP on f/t of its features: fc (and SwiGLU's gate) column-parallel under one f, proj
    row-parallel. The activation is elementwise, so it needs no communication."""

    def __init__(self, mlp: MLP, tp: TPGroup):
        super().__init__()
        self.tp, self.swiglu = tp, mlp.swiglu
        if self.swiglu:
            self.gate = ColumnParallelLinear(mlp.gate, tp)
        self.fc, self.proj = ColumnParallelLinear(mlp.fc, tp), RowParallelLinear(mlp.proj, tp)

    def forward(self, x):
        if self.swiglu:
            gate, up = column_parallel(x, [self.gate, self.fc], self.tp)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(column_parallel(x, [self.fc], self.tp)[0], approximate="tanh"))


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the rows of the ids [r V/t, (r+1) V/t): it looks
    up those, zeros the rest, g sums."""

    def __init__(self, emb: nn.Embedding, tp: TPGroup):
        super().__init__()
        self.tp, self.weight = tp, _shard(emb.weight, 0, tp)

    def forward(self, idx):                                              # (B, T) -> (B, T, h)
        rows = self.weight.shape[0]
        local = idx - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0),
                          self.weight).masked_fill(outside[..., None], 0.0)
        return self.tp.exit(out)


class SequenceShardedPositions(nn.Module):
    """With SP, the position embedding of this rank's part of the sequence only: (T/t, h)."""

    def __init__(self, emb: nn.Embedding, tp: TPGroup):
        super().__init__()
        self.tp, self.weight = tp, _replicated(emb.weight, tp)

    def forward(self, positions):
        return F.embedding(positions.tensor_split(self.tp.size)[self.tp.rank], self.weight)


# -----------------------------------------------------------------------------
# the vocab-parallel loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from logit slices (N, V/t) on each rank, the full (N, V) never formed.

    loss_i = log sum_v exp(z_iv - m_i) + m_i - z_i,target, m_i the max over the whole vocabulary:
    each rank reduces its slice, then one all-gather (the maxima) and two all-reduces (the sums of
    exponentials, the target logit, which only its owner holds) of N values complete it.
    Backward is local: (softmax - one_hot) / N on the slice, from the softmax kept in forward."""

    @staticmethod
    def forward(ctx, logits, targets, tp):
        n, cols = logits.shape
        maxes = tp.ops.all_gather(logits.max(-1).values[None].contiguous(), tp.group)   # (t, N)
        m = maxes.max(0).values                                                          # (N,)
        exp = (logits - m[:, None]).exp_()
        sum_exp = tp.ops.all_reduce(exp.sum(-1), tp.group)
        local = targets - tp.rank * cols
        mine = (local >= 0) & (local < cols)
        local = local.clamp(0, cols - 1)
        target = tp.ops.all_reduce(logits.gather(1, local[:, None])[:, 0] * mine, tp.group)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, mine)
        return (sum_exp.log() + m - target).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        softmax[torch.arange(len(local)), local] -= mine.to(softmax.dtype)   # in place: used once
        return softmax.mul_(grad / len(local)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 tp: TPGroup) -> torch.Tensor:
    """Mean next-token loss from this rank's logit slice (B, T, V/t) and the targets (B, T)."""
    return _VocabParallelCrossEntropy.apply(rearrange(logits, "b t v -> (b t) v").float(),
                                            rearrange(targets, "b t -> (b t)"), tp)


# ----------------------------------------------------------------------------- the whole model


def apply_tp(model: GPT, tp: TPGroup) -> GPT:
    """Split the single-device GPT in place: each matrix cut from its full initialisation, so every
    t trains the same model. Parameter names stay the GPT's. Returns the model, whose forward now
    gives this rank's logit slice (B, T, V/t): train it with `vocab_parallel_cross_entropy`."""
    cfg = model.cfg
    for name, size in tp_sizes(cfg).items():  # (n_head divides d_model)
        if size % tp.size:
            raise ValueError(f"tp ({tp.size}) must divide the model's {name} ({size})")
    if tp.sequence_parallel and cfg.seq_len % tp.size:
        raise ValueError(f"sequence_parallel needs seq_len ({cfg.seq_len}) to divide by tp "
                         f"({tp.size})")
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, tp)
    if tp.sequence_parallel:
        model.pos_emb = SequenceShardedPositions(model.pos_emb, tp)
    for block in model.blocks:
        block.attn = ParallelAttention(block.attn, tp)
        if isinstance(block.mlp, MLP):  # a mixture of experts stays whole (EP cuts it)
            block.mlp = ParallelMLP(block.mlp, tp)
        for norm in (block.ln1, block.ln2):
            norm.weight, norm.bias = _replicated(norm.weight, tp), _replicated(norm.bias, tp)
    model.ln_f.weight, model.ln_f.bias = _replicated(model.ln_f.weight,
                                                     tp), _replicated(model.ln_f.bias, tp)
    model.head = ColumnParallelLinear(model.head, tp)
    if cfg.tie_embeddings:  # the same vocabulary rows as the embedding's block
        model.head.weight = model.tok_emb.weight
    return model


def sync_sequence_parallel_grads(grads: list, tp: TPGroup) -> None:
    """With SP, sum the partial gradients of the shard-used parameters (`sequence_partial`; `grads`,
    wherever they are held) over the group, in place: one all-reduce."""
    grads = [g for g in grads if g is not None and g.numel()]
    if not grads:
        return
    flat = tp.ops.all_reduce(torch.cat([g.reshape(-1) for g in grads]), tp.group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def sequence_partial(p) -> bool:
    """Whether SP leaves p's gradient partial on each TP rank (LayerNorms, row-parallel biases)."""
    return getattr(p, "sequence_partial", False)
