"""Mixture of experts: an MLP layer of n experts, each token sent to its top k (Shazeer et al. 2017;
Switch Transformer, Fedus et al. 2022; Mixtral, Jiang et al. 2024; DeepSeek-V3, 2024).

    router      scores = softmax(x W_r) over the n experts; each token goes to its k best, its
                output the sum of those experts' outputs weighted by their scores renormalised to
                sum to 1 over the k (Mixtral's rule: softmax over the top-k logits)
    balance     Switch's auxiliary loss, added to the training loss with a small weight alpha:
                    L_aux = alpha n sum_i f_i P_i
                f_i the fraction of the token-slots (tokens x k) routed to expert i, P_i the mean
                score of expert i over the tokens; it is alpha at a uniform routing and grows as
                routing concentrates (f is counted, not differentiated: gradients flow through P)
    bias        DeepSeek-V3's auxiliary-loss-free balancing, as an option: a bias b_i added to the
                scores to choose the k experts (not to weight them); after each step b_i moves by
                `bias_speed` towards balance: down if expert i got more than the mean, up if less
                (DeepSeek-V3 biases sigmoid scores; here they are the softmax's)
    capacity    each expert takes at most C = ceil(capacity_factor x tokens x k / n) token-slots,
                first come first served in token order; the rest are dropped (that expert adds
                nothing for them: the residual carries them). capacity_factor=None: dropless

Experts are stored stacked (one tensor per weight over all experts), so expert parallelism can
cut them along the first axis. A token's slots are dispatched by sorting them by expert: each
expert runs once on a contiguous slice (an expert that receives no token runs on an empty slice,
and its gradients are zeros), and the outputs are scattered back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Routing:
    """What one forward's router decided, for the loss, the plots and expert parallelism."""
    experts: torch.Tensor      # (tokens, k) chosen expert ids
    gates: torch.Tensor        # (tokens, k) their weights (0 where the slot was dropped)
    kept: torch.Tensor         # (tokens, k) bool: the slot fit in its expert's capacity
    counts: torch.Tensor       # (n,) token-slots each expert received (after capacity)
    balance_loss: torch.Tensor  # Switch's L_aux, alpha included

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


class MoE(nn.Module):
    """x (..., h) -> (y (..., h), Routing): n_expert GELU MLPs of width f, top_k of them a token."""

    def __init__(self, d_model: int, ffn: int, n_expert: int, top_k: int = 2,
                 capacity_factor: float | None = None, alpha: float = 0.01,
                 bias_speed: float = 0.0):
        super().__init__()
        if not (isinstance(n_expert, int) and isinstance(top_k, int) and 1 <= top_k <= n_expert):
            raise ValueError(f"need 1 <= top_k <= n_expert (integers), got top_k={top_k!r}, "
                             f"n_expert={n_expert!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive or None (dropless), got "
                             f"{capacity_factor!r}")
        self.n_expert, self.top_k, self.capacity_factor = n_expert, top_k, capacity_factor
        self.alpha, self.bias_speed = alpha, bias_speed
        self.router = nn.Linear(d_model, n_expert, bias=False)
        self.fc = nn.Parameter(torch.randn(n_expert, d_model, ffn) * 0.02)
        self.fc_bias = nn.Parameter(torch.zeros(n_expert, ffn))
        self.proj = nn.Parameter(torch.randn(n_expert, ffn, d_model) * 0.02)
        self.proj_bias = nn.Parameter(torch.zeros(n_expert, d_model))
        # DeepSeek-V3's selection bias: state that training updates by rule, not by gradient
        self.register_buffer("select_bias", torch.zeros(n_expert))

    def capacity(self, tokens: int) -> int | None:
        """C: the token-slots an expert takes from `tokens` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_expert)

    def route(self, x: torch.Tensor) -> Routing:
        """The router's choice for x (tokens, h)."""
        scores = F.softmax(self.router(x).float(), dim=-1)                     # (tokens, n)
        experts = torch.topk(scores + self.select_bias, self.top_k, dim=-1).indices
        gates = scores.gather(1, experts)
        gates = gates / gates.sum(-1, keepdim=True)
        slots = experts.flatten()
        # first come first served: a slot's rank among the earlier slots of its expert
        order = F.one_hot(slots, self.n_expert).cumsum(0).gather(1, slots[:, None])[:, 0] - 1
        cap = self.capacity(len(x))
        kept = (order < cap if cap is not None else torch.ones_like(slots, dtype=torch.bool))
        kept = kept.view_as(experts)
        counts = torch.bincount(experts[kept], minlength=self.n_expert)
        f = torch.bincount(slots, minlength=self.n_expert).float() / len(slots)
        balance = self.alpha * self.n_expert * (f * scores.mean(0)).sum()
        return Routing(experts, gates * kept, kept, counts, balance)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.route(x)
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
        """Expert e's MLP on its tokens x (m, h): proj(GELU(fc x))."""
        hidden = F.gelu(x @ self.fc[e] + self.fc_bias[e], approximate="tanh")
        return hidden @ self.proj[e] + self.proj_bias[e]

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's rule after a step: b_i -= speed x sign(count_i - mean count)."""
        load = counts.float()
        self.select_bias -= self.bias_speed * torch.sign(load - load.mean())
