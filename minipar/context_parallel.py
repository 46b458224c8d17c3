"""Context parallelism: one sequence's tokens split over the ranks of a CP group, and causal
attention computed across them. Everything but attention acts token by token, so only attention
needs the other ranks' tokens; three ways to bring them, the simplest first:

    all-gather  every rank gathers the whole K and V once, attends its own queries to them, and
                the backward reduce-scatters dK and dV (Llama 3's choice, Dubey et al. 2024 §3.3.2:
                its K/V are small under grouped-query attention)
    ring        K/V blocks travel round the ring of ranks, each step overlapped with the attention
                of the block already held; partial results merge by the log-sum-exp rule (the
                online softmax of flash attention), so no rank ever holds more than two blocks;
                the backward sends K/V round again, and dK/dV travel with them back to their owner
                (Liu et al. 2023, ring attention)
    ulysses     an all-to-all turns "my tokens, every head" into "every token, my heads", each rank
                attends its heads over the whole sequence, and a second all-to-all turns it back
                (Jacobs et al. 2023, DeepSpeed-Ulysses); needs heads and KV heads divisible by cp

Causal balance: with the sequence cut into cp contiguous pieces, the last rank's queries see every
key and the first's almost none. `positions(T, cp, rank)` instead cuts it into 2 cp chunks and gives
rank r chunks r and 2cp-1-r (Llama 3's load balancing), so every rank attends about T^2 / (2 cp)
query-key pairs. Any T >= 2 cp works; chunks differ by at most one token (`torch.tensor_split`).
Masks follow the tokens' global positions, so any assignment of positions is correct.

In training (`apply_cp`, from parallelize.py with ParallelConfig(cp=, cp_method=)): a CP rank holds
the whole model, its tokens of every sequence, their positions' embeddings, and a loss weighted by
cp T_r / T; the CP ranks are weight replicas, so DP and ZeRO reduce over dp x cp of them.

Per rank, for B sequences, hq query heads, hk KV heads of size d, its T_r tokens (T = sum T_r), and
e bytes an element (formulas checked by tests/test_context_parallel.py):
    sent, forward    all-gather: 2 B hk d e (cp-1) Tpad     (Tpad = max T_r: shards padded)
                     ring:       2 B hk d e (T - T_{r+1})   (every block but the next rank's own)
                     ulysses:    B d e ((hq + 2 hk) T_r (cp-1) + hq (T - T_r)) / cp
    sent, backward   all-gather: 2 B hk d e (cp-1) Tpad     (the reduce-scatter)
                     ring:       the forward's K/V again, plus 2 B hk d e T (dK, dV round the ring)
                     ulysses:    the forward's exchanges reversed: B d e ((hq + 2 hk) (T - T_r)
                                 + hq T_r (cp-1)) / cp
    held at once     all-gather: the whole K and V (2 B hk d T e)
                     ring:       two K/V blocks (the one in use and the one arriving)
                     ulysses:    q, k, v of every token for hq/cp heads
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minipar import comm

METHODS = ("ring", "all-gather", "ulysses")


def positions(seq_len: int, cp: int, rank: int, balanced: bool = True) -> torch.Tensor:
    """The global token positions rank holds: chunks rank and 2cp-1-rank of 2 cp (balanced), or
    chunk rank of cp (contiguous)."""
    if not (isinstance(cp, int) and cp >= 1 and 0 <= rank < cp):
        raise ValueError(f"cp must be a positive integer and rank in [0, cp), got {cp}, {rank}")
    if seq_len < (2 * cp if balanced else cp):
        raise ValueError(f"seq_len {seq_len} is shorter than the {2 * cp if balanced else cp} "
                         f"chunks context parallelism {cp} cuts it into")
    if not balanced:
        return torch.arange(seq_len).tensor_split(cp)[rank]
    chunks = torch.arange(seq_len).tensor_split(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


@functools.lru_cache(maxsize=64)
def _every(seq_len: int, cp: int, balanced: bool) -> tuple:
    """Every rank's positions (read only: each layer's attention asks again)."""
    return tuple(positions(seq_len, cp, r, balanced) for r in range(cp))


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1, balanced: bool = True):
    """The part of x (every token along `dim`) that rank holds."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, balanced))


def causal_pairs(seq_len: int, cp: int, rank: int, balanced: bool = True) -> int:
    """Query-key pairs rank's queries attend (each token attends itself and every earlier one)."""
    return int((positions(seq_len, cp, rank, balanced) + 1).sum())


def attention(q, k, v, seq_len: int, group=None, method: str = "ring", balanced: bool = True,
              stats: comm.CommStats | None = None) -> torch.Tensor:
    """Causal attention for this rank's tokens: q (B, hq, T_r, d), k and v (B, hk, T_r, d), the
    tokens at `positions(seq_len, cp, rank, balanced)`; returns (B, hq, T_r, d), query head i on
    KV head i // (hq / hk), as the single-device model's attention. Differentiable."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    rank, cp, _ = comm._group_info(group)
    pos = _every(seq_len, cp, balanced)
    if q.shape[2] != len(pos[rank]) or k.shape[2] != len(pos[rank]):
        raise ValueError(f"rank {rank} holds {len(pos[rank])} of the {seq_len} tokens, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if method == "ulysses" and (q.shape[1] % cp or k.shape[1] % cp):
        raise ValueError(f"ulysses splits the heads: {q.shape[1]} query and {k.shape[1]} KV heads "
                         f"must divide by cp {cp}")
    if method == "ring":
        return _Ring.apply(q, k, v, pos, group, stats)
    if method == "all-gather":
        return _gathered(q, k, v, pos, group, stats)
    return _ulysses(q, k, v, pos, group, stats)


def sent(method: str, seq_len: int, cp: int, rank: int, batch: int, hq: int, hk: int, d: int,
         elem: int, balanced: bool = True, backward: bool = True) -> dict:
    """{kind: bytes} rank sends for one forward and (backward=True) backward of `attention`
    (module docstring)."""
    t = [len(p) for p in _every(seq_len, cp, balanced)]
    kv = 2 * batch * hk * d * elem   # K and V of one token
    if cp == 1:
        return {}
    if method == "ring":
        forward = kv * (seq_len - t[(rank + 1) % cp])
        return {"cp_ring": forward + backward * (forward + kv * seq_len)}
    if method == "all-gather":
        return {"all_gather": kv * (cp - 1) * max(t),
                "reduce_scatter": backward * kv * (cp - 1) * max(t)}
    # my tokens out (cp - 1 times), and everyone else's back; the backward the same reversed
    out, back = (hq + 2 * hk) // cp, hq // cp
    forward = out * t[rank] * (cp - 1) + back * (seq_len - t[rank])
    reverse = out * (seq_len - t[rank]) + back * t[rank] * (cp - 1)
    return {"cp_all_to_all": batch * d * elem * (forward + backward * reverse)}


# ---------------------------------------------------------------------- applied to the model


def group_of(mesh, cp: int):
    """(this rank's CP group, its rank in it): cp consecutive ranks of the DP axis of a mesh built
    with dp * cp replicas (Megatron's order, tp innermost, then cp, then dp). Collective."""
    consecutive = lambda ranks: [ranks[i:i + cp] for i in range(0, len(ranks), cp)]  # noqa: E731
    return mesh.dp_subgroups(consecutive)[0], mesh.dp_rank % cp


def apply_cp(model, loss_fn, group, method: str, stats: comm.CommStats | None = None):
    """This rank's share of every sequence, in place: the model takes its tokens (and their
    positions' embeddings), attention reaches the group's other tokens by `method`, and the loss
    over its tokens is weighted by cp T_r / T, so that the average over the dp x cp ranks (the
    gradient reduction's) is the mean over every token. Returns (that loss function, the forward
    pre-hook that takes a module's token ids to this rank's: a pipeline's first chunk needs it
    too, since the model's own forward is not run there)."""
    rank, cp, _ = comm._group_info(group)
    seq_len = model.cfg.seq_len
    pos = positions(seq_len, cp, rank).to(model.pos_emb.weight.device)
    take = lambda _, args: (args[0].index_select(1, pos),)  # noqa: E731
    model.register_forward_pre_hook(take)
    model.pos_emb.register_forward_pre_hook(lambda _, args: (pos[args[0]],))
    for block in model.blocks:
        block.attn.core = lambda q, k, v: attention(q, k, v, seq_len, group, method, True, stats)
    weight = cp * len(pos) / seq_len
    return lambda logits, targets: loss_fn(logits, targets.index_select(1, pos)) * weight, take


# ------------------------------------------------------------------ blocks and their merge


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:   # KV heads to query heads (GQA)
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _fold(x: torch.Tensor, rep: int) -> torch.Tensor:     # query heads' gradients to KV heads
    return x.unflatten(1, (-1, rep)).sum(2) if rep > 1 else x


def _scores(q, k, pq, pk):
    """q k^T / sqrt(d), -inf where a key comes after the query (global positions)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    return s.masked_fill(pk[None, :] > pq[:, None], float("-inf"))


def _wide(dtype: torch.dtype) -> torch.dtype:   # what softmax sums in: fp32 at least
    return torch.promote_types(dtype, torch.float32)


def _finite(lse: torch.Tensor) -> torch.Tensor:   # -inf (no key) as 0, so exp(s - it) stays 0
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _block(q, k, v, pq, pk):
    """(out, lse) of q's rows over one block of keys: out = softmax(s) v over the keys the causal
    mask leaves, lse = logsumexp(s) in fp32 (as flash attention keeps it); a row with none: out 0,
    lse -inf."""
    s = _scores(q, k, pq, pk)
    s = s.to(_wide(s.dtype))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - _finite(lse)[..., None]).to(v.dtype) @ v, lse


def _merge(out, lse, o, l):
    """Two partial attentions of the same rows over disjoint keys, as one: each weighted by its
    share of the total exp-sum, exp(lse_i - lse)."""
    new = torch.logaddexp(lse, l)
    safe = _finite(new)
    return out * torch.exp(lse - safe)[..., None] + o * torch.exp(l - safe)[..., None], new


def _block_grads(q, k, v, dout, lse, delta, pq, pk):
    """(dq, dk, dv) of one block, from the final lse and delta = rowsum(dout * out): the flash
    attention backward, p = exp(s - lse), ds = p (dout v^T - delta)."""
    p = torch.exp(_scores(q, k, pq, pk) - lse[..., None])
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - delta[..., None]) * q.shape[-1] ** -0.5
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dout


def _skip(pq, pk) -> bool:   # every key after every query: the block adds nothing
    return len(pq) == 0 or len(pk) == 0 or bool(pk.min() > pq.max())


# ---------------------------------------------------------------------------------- the ring


def _neighbours(group):
    rank, n, ranks = comm._group_info(group)
    return rank, n, ranks[(rank + 1) % n], ranks[(rank - 1) % n]


def _start(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group, stats):
    """Send to dst and receive from src as one batch (NCCL needs them paired); the works."""
    comm._record(stats, "cp_ring", send.numel() * send.element_size())
    return dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, src, group),
                                   dist.P2POp(dist.isend, send, dst, group)])


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos, group, stats):
        rank, n, nxt, prv = _neighbours(group)
        rep = q.shape[1] // k.shape[1]
        # the partial results merge in fp32 (a 16-bit model's too: flash attention's accumulator)
        wide = _wide(q.dtype)   # (q's layout below: heads-last, as SDPA's output)
        out = torch.zeros_like(q, dtype=wide)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
        kv = torch.stack([k, v])
        comm._record(stats, "cp_ring", calls=1)
        for step in range(n):
            owner = (rank - step) % n
            works = []
            if step < n - 1:   # the next block arrives while this one is attended
                incoming = kv.new_empty((*kv.shape[:3], len(pos[(owner - 1) % n]), kv.shape[-1]))
                works = _start(kv.contiguous(), nxt, incoming, prv, group, stats)
            if not _skip(pos[rank], pos[owner]):
                o, l = _block(q, _expand(kv[0], rep), _expand(kv[1], rep), pos[rank], pos[owner])
                out, lse = _merge(out, lse, o, l)
            comm.wait(*works)
            kv = incoming if step < n - 1 else kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pos, ctx.group, ctx.stats = pos, group, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dtype = q.dtype   # (the backward runs in fp32 at least, its results cast back)
        q, k, v, out, dout = (x.to(_wide(dtype)) for x in (q, k, v, out, dout))
        pos, group, stats = ctx.pos, ctx.group, ctx.stats
        rank, n, nxt, prv = _neighbours(group)
        rep = q.shape[1] // k.shape[1]
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        block = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # K, V, dK, dV
        comm._record(stats, "cp_ring", calls=1)
        for step in range(n):
            owner = (rank - step) % n
            if not _skip(pos[rank], pos[owner]):
                gq, gk, gv = _block_grads(q, _expand(block[0], rep), _expand(block[1], rep),
                                          dout, lse, delta, pos[rank], pos[owner])
                dq += gq
                block[2] += _fold(gk, rep)
                block[3] += _fold(gv, rep)
            # pass the block on with its gradients so far; the last step sends them home
            send = block if step < n - 1 else block[2:]
            size = len(pos[(owner - 1) % n]) if step < n - 1 else len(pos[rank])
            incoming = block.new_empty((len(send), *block.shape[1:3], size, block.shape[-1]))
            if n > 1:
                comm.wait(*_start(send.contiguous(), nxt, incoming, prv, group, stats))
                block = incoming
        dk, dv = (block[0], block[1]) if n > 1 else (block[2], block[3])
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None


# ---------------------------------------------------------------------------- the all-gather


class _Gather(torch.autograd.Function):
    """Every rank's x (seq first, padded to one length) stacked: (cp * Tpad, ...); the backward
    reduce-scatters the gradient, so each rank gets the sum of its rows' gradients."""
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return comm.all_gather(x.contiguous(), group, stats)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad.contiguous(), ctx.group, ctx.stats), None, None


def _gathered(q, k, v, pos, group, stats):
    rank, n, _ = comm._group_info(group)
    pad = max(len(p) for p in pos)
    kv = F.pad(torch.stack([k, v]), (0, 0, 0, pad - k.shape[2])).movedim(3, 0)  # (Tpad,2,B,hk,d)
    every = _Gather.apply(kv, group, stats)
    rows = torch.cat([r * pad + torch.arange(len(p)) for r, p in enumerate(pos)])
    kv = every[rows].movedim(0, 3)                                               # (2, B, hk, T, d)
    mask = torch.cat(pos)[None, :] <= pos[rank][:, None]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask,
                                          enable_gqa=k.shape[1] != q.shape[1])


# -------------------------------------------------------------------------------- ulysses


def _ulysses(q, k, v, pos, group, stats):
    rank, n, _ = comm._group_info(group)
    mine, every = len(pos[rank]), [len(p) for p in pos]
    hq, hk = q.shape[1] // n, k.shape[1] // n
    # to rank g: my tokens of its heads; from rank g: its tokens of my heads, by rank
    send = torch.cat([torch.cat([q[:, g * hq:(g + 1) * hq], k[:, g * hk:(g + 1) * hk],
                                 v[:, g * hk:(g + 1) * hk]], 1).movedim(2, 0) for g in range(n)])
    got = comm.all_to_all(send, [mine] * n, every, group, stats, "cp_all_to_all")  # (T,B,hq+2hk,d)
    order = torch.argsort(torch.cat(pos))                                 # rows to positions
    qkv = got[order].movedim(0, 2)                                        # (B, hq + 2hk, T, d)
    o = F.scaled_dot_product_attention(qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:],
                                       is_causal=True, enable_gqa=hk != hq)
    back = o.movedim(2, 0)[torch.cat(pos)]                                # rows by rank again
    # (n T_r, B, hq, d): my tokens, every rank's heads, by rank
    mine_all = comm.all_to_all(back, every, [mine] * n, group, stats, "cp_all_to_all")
    return torch.cat(mine_all.split(mine, 0), 2).movedim(0, 2)            # (B, n hq, T_r, d)
