"""Mixture of experts: an MLP layer of n experts, each token sent to its top k (Shazeer et al. 2017;
Switch Transformer, Fedus et al. 2022; Mixtral, Jiang et al. 2024; DeepSeek-V3, 2024).

    router      scores = softmax(x W_r) over the n experts; each token goes to its k best, its
                output the sum of those experts' outputs weighted by their scores renormalised to
                sum to 1 over the k (Mixtral's rule: softmax over the top-k logits)
    balance     Switch's auxiliary loss, added to the training loss with a small weight alpha:
                    L_aux = alpha n sum_i f_i P_i
                f_i the fraction of the token-slots (tokens x k) routed to expert i, P_i the mean
                score of expert i over the tokens; it is alpha at a uniform routing and grows as
                routing concentrates (f is counted, not differentiated: gradients flow through P).
                Over which tokens: each sequence's, averaged over the sequences (DeepSeek-V3's
                "sequence-wise" form). Switch counted a device's whole batch, so the loss changed
                with the layout (rows per rank, micro-batches); per sequence every layout computes
                the same loss. A 2-D input (tokens, h) is one sequence.
    bias        DeepSeek-V3's auxiliary-loss-free balancing, as an option: a bias b_i added to the
                scores to choose the k experts (not to weight them); after each step b_i moves by
                `bias_speed` towards balance: down if expert i got more than the mean, up if less
                (DeepSeek-V3 biases sigmoid scores; here they are the softmax's)
    capacity    each expert takes at most C = ceil(capacity_factor x T x k / n) token-slots of a
                sequence of T tokens (GShard's "group" is the sequence, for the same reason),
                first come first served in token order; the rest are dropped (that expert adds
                nothing for them: the residual carries them). capacity_factor=None: dropless
    experts     GELU MLPs proj(GELU(fc x)) with biases, or SwiGLU ones proj(SiLU(gate x) * fc x)
                without (Mixtral's, DeepSeek-V3's)

In a model the balance loss does not go through the logits: `with_balance_loss` hangs it on the
layer's output, and backward adds its gradient, times `aux_scale`, there (Megatron-LM's
MoEAuxLossAutoScaler). A pipeline stage then trains its layers' balance without the last stage
knowing it; the training loop sets aux_scale to what it multiplies the language-model loss by
(1 / micro-batches, a DP rank's weight, fp16's loss scale), so both gradients are those of
    loss = cross-entropy + the sum over MoE layers of L_aux.

Experts are stored stacked (one tensor per weight over all experts, `EXPERT_WEIGHTS`), so expert
parallelism can cut them along the first axis. A token's slots are dispatched by sorting them by
expert: each
expert runs once on a contiguous slice (an expert that receives no token runs on an empty slice,
and its gradients are zeros), and the outputs are scattered back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# the stacked expert weights, in the order MoE registers them
EXPERT_WEIGHTS = {"gelu": ("fc", "proj", "fc_bias", "proj_bias"), "swiglu": ("gate", "fc", "proj")}


@dataclass
class Routing:
    """What one forward's router decided, for the loss, the plots and expert parallelism."""
    experts: torch.Tensor      # (tokens, k) chosen expert ids
    gates: torch.Tensor        # (tokens, k) their weights (0 where the slot was dropped)
    kept: torch.Tensor         # (tokens, k) bool: the slot fit in its expert's capacity
    counts: torch.Tensor       # (n,) token-slots each expert received (after capacity)
    balance_loss: torch.Tensor  # Switch's L_aux per sequence, their mean, alpha included

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


class MoE(nn.Module):
    """x (..., T, h) or (tokens, h) -> (y of x's shape, Routing): n_expert MLPs of width f (mlp
    "gelu" or "swiglu"), top_k of them a token."""
    SETTINGS = ("n_expert", "top_k", "capacity_factor", "alpha", "bias_speed", "mlp", "aux_scale")

    def __init__(self, d_model: int, ffn: int, n_expert: int, top_k: int = 2,
                 capacity_factor: float | None = None, alpha: float = 0.01,
                 bias_speed: float = 0.0, mlp: str = "gelu"):
        super().__init__()
        if not (isinstance(n_expert, int) and isinstance(top_k, int) and 1 <= top_k <= n_expert):
            raise ValueError(f"need 1 <= top_k <= n_expert (integers), got top_k={top_k!r}, "
                             f"n_expert={n_expert!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive or None (dropless), got "
                             f"{capacity_factor!r}")
        if mlp not in EXPERT_WEIGHTS:
            raise ValueError(f"mlp must be one of {tuple(EXPERT_WEIGHTS)}, got {mlp!r}")
        self.n_expert, self.top_k, self.capacity_factor = n_expert, top_k, capacity_factor
        self.alpha, self.bias_speed, self.mlp = alpha, bias_speed, mlp
        self.aux_scale = 1.0   # what backward multiplies L_aux's gradient by (module docstring)
        self.router = nn.Linear(d_model, n_expert, bias=False)
        if mlp == "swiglu":
            self.gate = nn.Parameter(torch.randn(n_expert, d_model, ffn) * 0.02)
        self.fc = nn.Parameter(torch.randn(n_expert, d_model, ffn) * 0.02)
        self.proj = nn.Parameter(torch.randn(n_expert, ffn, d_model) * 0.02)
        if mlp == "gelu":
            self.fc_bias = nn.Parameter(torch.zeros(n_expert, ffn))
            self.proj_bias = nn.Parameter(torch.zeros(n_expert, d_model))
        # DeepSeek-V3's selection bias: state that training updates by rule, not by gradient
        self.register_buffer("select_bias", torch.zeros(n_expert))
        # the token-slots each expert got over a training step, for that rule (`balance_step`)
        self.register_buffer("load", torch.zeros(n_expert, dtype=torch.int64), persistent=False)

    def capacity(self, tokens: int) -> int | None:
        """C: the token-slots an expert takes from a sequence of `tokens` (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_expert)

    def route(self, x: torch.Tensor, sequences: int = 1) -> Routing:
        """The router's choice for x (tokens, h): `sequences` sequences of equal length, one after
        the other (the balance loss and the capacity are each sequence's)."""
        n, k = self.n_expert, self.top_k
        scores = F.softmax(self.router(x).float(), dim=-1)                     # (tokens, n)
        experts = torch.topk(scores + self.select_bias, k, dim=-1).indices
        gates = scores.gather(1, experts)
        gates = gates / gates.sum(-1, keepdim=True)
        slots = F.one_hot(experts, n).view(sequences, -1, n)          # (sequences, T k, n)
        # first come first served: a slot's rank among its sequence's earlier slots of its expert
        order = (slots.cumsum(1) * slots).sum(-1) - 1                 # (sequences, T k)
        cap = self.capacity(len(x) // sequences)
        kept = (order < cap if cap is not None else torch.ones_like(order, dtype=torch.bool))
        kept = kept.view_as(experts)
        counts = torch.bincount(experts[kept], minlength=n)
        if self.training and self.bias_speed:  # (recomputation counts twice: the signs stay)
            self.load += counts
        f = slots.float().mean(1)                                     # (sequences, n)
        p = scores.view(sequences, -1, n).mean(1)
        balance = self.alpha * n * (f * p).sum(-1).mean()
        return Routing(experts, gates * kept, kept, counts, balance)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.route(x, math.prod(shape[:-2]))   # (2-D: one sequence)
        tokens, gates = self.slots(routing)
        parts = tokens.split(routing.counts.tolist())
        outs = [self.expert(e, x[part]) for e, part in enumerate(parts)]
        y = torch.zeros_like(x).index_add(0, tokens, torch.cat(outs) * gates.to(x.dtype)[:, None])
        return y.view(shape), routing

    def slots(self, routing: Routing):
        """(token, gate) of every slot that fit, grouped by expert (token order within): the
        order the experts take them in."""
        keep = routing.kept.flatten()                        # token-major
        experts = routing.experts.flatten()[keep]
        tokens = torch.arange(len(routing.experts), device=experts.device)
        tokens = tokens.repeat_interleave(self.top_k)[keep]
        order = torch.argsort(experts, stable=True)
        return tokens[order], routing.gates.flatten()[keep][order]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP on its tokens x (m, h): proj(GELU(fc x)) or proj(SiLU(gate x) fc x)."""
        if self.mlp == "swiglu":
            return (F.silu(x @ self.gate[e]) * (x @ self.fc[e])) @ self.proj[e]
        hidden = F.gelu(x @ self.fc[e] + self.fc_bias[e], approximate="tanh")
        return hidden @ self.proj[e] + self.proj_bias[e]

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's rule after a step: b_i -= speed x sign(count_i - mean count)."""
        load = counts.float()
        self.select_bias -= self.bias_speed * torch.sign(load - load.mean())


def balance_step(model: nn.Module, group=None) -> None:
    """After a training step, DeepSeek-V3's rule on every MoE layer of `model` that uses it, with
    the loads summed over `group` (the DP ranks: every layout then moves the same biases)."""
    for moe in layers(model):
        if moe.bias_speed:
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(moe.load, group=group)
            moe.update_bias(moe.load)
            moe.load.zero_()


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """What backward multiplies every MoE layer's balance loss gradient by, from now on: what the
    language-model loss is multiplied by (1 / micro-batches, a rank's weight, a loss scale)."""
    for moe in layers(model):
        moe.aux_scale = scale


class _BalanceLoss(torch.autograd.Function):
    """y unchanged forward; backward also gives the balance loss its gradient, `scale`."""

    @staticmethod
    def forward(ctx, y, balance, scale):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None


def with_balance_loss(moe: MoE, y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """y, carrying `routing`'s balance loss into backward (times moe.aux_scale): what a model's
    MoE layer adds to the residual, so it trains its balance wherever its loss is."""
    if not routing.balance_loss.requires_grad:
        return y
    return _BalanceLoss.apply(y, routing.balance_loss, moe.aux_scale)


def layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of a model (or of a pipeline rank's share of it)."""
    return [m for m in model.modules() if isinstance(m, MoE)]
