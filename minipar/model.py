"""A GPT written for one device: the model every parallel layout must reproduce.

Decoder-only transformer in the GPT-2 shape (Radford et al. 2019; the code follows nanoGPT):
learned positions, pre-LayerNorm blocks, causal self-attention through
`F.scaled_dot_product_attention`, a 4h GELU MLP, and an output head that is *not* tied to the token
embedding (so the first and the last pipeline stage own separate weights). Two departures from
GPT-2: the head is untied, and the key projection has no bias. A key bias adds the same q.b to every
score of a row, which softmax ignores: its gradient is zero up to rounding, and Adam would turn that
rounding into updates that differ between layouts (Whisper drops it for the same reason).

Size, with h = d_model, l = n_layer, V = vocab_size, s = seq_len (biases and LayerNorms included):
    parameters  P = 12 l h^2 + 12 l h + 2 V h + s h + 2 h + V      (`GPTConfig.num_params`)
    FLOPs per token, forward + backward, no recomputation (Korthikanti
    et al. 2022, eq. 7, per token):
                72 l h^2 (1 + s/(6h) + V/(12 l h))                 (`GPTConfig.flops_per_token`)
This file knows nothing about ranks; parallelism is applied from outside.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from minipar.data import CharTokenizer


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4        # transformer blocks
    n_head: int = 4         # attention heads; d_model must divide by it
    d_model: int = 64       # hidden size h
    vocab_size: int = 96    # tokens; 96 = the character tokenizer of minipar.data
    seq_len: int = 64       # context length s (positions learned up to it)
    dropout: float = 0.0    # off by default, so that every layout computes the same function

    PRESETS = {  # name -> fields; the GPT-2 sizes pad the vocabulary to 50304 (a multiple of 128)
        "tiny":        dict(n_layer=4, n_head=4, d_model=64, vocab_size=96, seq_len=64),
        "small-cpu":   dict(n_layer=6, n_head=6, d_model=192, vocab_size=96, seq_len=128),
        "gpt2-small":  dict(n_layer=12, n_head=12, d_model=768, vocab_size=50304, seq_len=1024),
        "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, vocab_size=50304, seq_len=1024),
        "gpt2-large":  dict(n_layer=36, n_head=20, d_model=1280, vocab_size=50304, seq_len=1024),
        "gpt2-xl":     dict(n_layer=48, n_head=25, d_model=1600, vocab_size=50304, seq_len=1024),
    }

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must divide by n_head "
                             f"({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in cls.PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        l, h, V, s = self.n_layer, self.d_model, self.vocab_size, self.seq_len
        return 12 * l * h * h + 12 * l * h + 2 * V * h + s * h + 2 * h + V

    @property
    def flops_per_token(self) -> float:
        l, h, V, s = self.n_layer, self.d_model, self.vocab_size, self.seq_len
        return 72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # see the module docstring
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):                                                    # (B, T, h)
        q, k, v = (rearrange(lin(x), "b t (nh hd) -> b nh t hd", nh=self.n_head)
                   for lin in (self.q, self.k, self.v))
        return self.proj(rearrange(self.core(q, k, v), "b nh t hd -> b t (nh hd)"))  # (B, T, h)

    def core(self, q, k, v):  # (B, nh, T, hd) each -> (B, nh, T, hd): causal
                              #   softmax(q k^T / sqrt(hd)) v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """model(idx) -> logits: idx (B, T) int64 token ids, logits (B, T, vocab_size)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2l)
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                           # (B, T, V)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over every position: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(rearrange(logits, "b t v -> (b t) v").float(),
                           rearrange(targets, "b t -> (b t)"))


@torch.no_grad()
def sample(model: GPT, prompt: str, length: int, temperature: float = 0.8, seed: int = 0,
           tokenizer=None) -> str:
    """Continue `prompt` by `length` tokens, sampling from the model; `tokenizer` (with encode and
    decode: a data.Dataset, say) the one the model was trained with, by default CharTokenizer."""
    tok, gen = tokenizer or CharTokenizer(), torch.Generator().manual_seed(seed)
    model.eval()
    idx = tok.encode(prompt)[None].to(next(model.parameters()).device)  # (1, T)
    for _ in range(length):
        logits = model(idx[:, -model.cfg.seq_len:])[0, -1].float().cpu() / temperature
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)
        idx = torch.cat([idx, nxt[None].to(idx.device)], dim=1)
    return tok.decode(idx[0].tolist())
