"""A GPT written for one device: the model every parallel layout must reproduce.

Decoder-only transformer in the GPT-2 shape (Radford et al. 2019; the code follows nanoGPT):
learned positions, pre-LayerNorm blocks, causal self-attention through
`F.scaled_dot_product_attention`, a 4h GELU MLP, and an output head that is *not* tied to the token
embedding by default (so the first and the last pipeline stage own separate weights). Two
departures from GPT-2: the head is untied, and the key projection has no bias. A key bias adds the
same q.b to every score of a row, which softmax ignores: its gradient is zero up to rounding, and
Adam would turn that rounding into updates that differ between layouts (Whisper drops it for the
same reason).

Today's shapes, as options (Llama 3's, Dubey et al. 2024, Table 3; LayerNorm, learned positions and
the attention biases stay GPT-2's, so only the shapes change):
    n_kv_head       grouped-query attention (Ainslie et al. 2023): k and v have n_kv_head heads,
                    each shared by n_head / n_kv_head query heads
    ffn_hidden      the MLP's width f (default 4 h)
    mlp="swiglu"    proj(silu(gate x) * fc x), three f x h matrices, no biases (Shazeer 2020)
    tie_embeddings  the head's weight is the token embedding's, and the head has no bias
    n_expert > 0    a mixture of experts in place of every MLP (moe.py): n_expert MLPs of the
                    `mlp` kind and width f, top_k of them a token, a router (h n), Switch's
                    balance loss weighted moe_alpha, capacity_factor (None: dropless) and
                    DeepSeek-V3's selection bias moving moe_bias_speed a step (0: off)

Size, with h = d_model, l = n_layer, V = vocab_size, s = seq_len, k = n_kv_head h / n_head (the
key and value width), f = ffn_hidden (biases and LayerNorms included):
    parameters  P = l (W + B) + V h + s h + 2 h + (V h + V, untied)   (`GPTConfig.num_params`)
                W = 2 h^2 + 2 h k + 2 h f (gelu) or 3 h f (swiglu)     the matrices of a layer
                B = 6 h + k + (f + h, gelu)     its biases (q, v, proj; fc and proj) and LayerNorms
                (GPT-2: W = 12 h^2, B = 12 h)
                with n experts: the MLP's matrices and biases n times, plus the router's h n
    FLOPs per token, forward + backward, no recomputation (Korthikanti et al. 2022, eq. 7, per
    token, there 72 l h^2 (1 + s/(6h) + V/(12 l h)) for W = 12 h^2):
                6 l W + 12 l s h + 6 V h                               (`GPTConfig.flops_per_token`)
                with experts W counts the k MLPs a token goes through, and the router's h n
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
from minipar.moe import MoE, with_balance_loss


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4        # transformer blocks
    n_head: int = 4         # attention heads; d_model must divide by it
    d_model: int = 64       # hidden size h
    vocab_size: int = 96    # tokens; 96 = the character tokenizer of minipar.data
    seq_len: int = 64       # context length s (positions learned up to it)
    dropout: float = 0.0    # off by default, so that every layout computes the same function
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    ffn_hidden: int | None = None  # the MLP's width f; None: 4 d_model
    mlp: str = "gelu"       # "gelu" (GPT-2) or "swiglu" (Llama)
    tie_embeddings: bool = False  # the head's weight is the token embedding's (no head bias)
    n_expert: int = 0       # > 0: a mixture of experts in every block (moe.py); 0: the dense MLP
    top_k: int = 2          # experts a token goes to (n_expert > 0)
    capacity_factor: float | None = None  # token-slots an expert takes, over the even share
                                          #   (None: dropless)
    moe_alpha: float = 0.01  # the weight of Switch's balance loss
    moe_bias_speed: float = 0.0  # DeepSeek-V3's bias-based balancing: its step (0: off)

    PRESETS = {  # name -> fields; the GPT-2 sizes pad the vocabulary to 50304 (a multiple of 128)
        "tiny":        dict(n_layer=4, n_head=4, d_model=64, vocab_size=96, seq_len=64),
        "small-cpu":   dict(n_layer=6, n_head=6, d_model=192, vocab_size=96, seq_len=128),
        "gpt2-small":  dict(n_layer=12, n_head=12, d_model=768, vocab_size=50304, seq_len=1024),
        "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, vocab_size=50304, seq_len=1024),
        "gpt2-large":  dict(n_layer=36, n_head=20, d_model=1280, vocab_size=50304, seq_len=1024),
        "gpt2-xl":     dict(n_layer=48, n_head=25, d_model=1600, vocab_size=50304, seq_len=1024),
        # Llama 3's shapes (Dubey et al. 2024, Table 3: layers, model dimension, FFN dimension,
        # heads, key/value heads; vocabulary 128K = 128256), at 8K context (its pre-training
        # length)
        "llama-tiny":  dict(n_layer=4, n_head=8, n_kv_head=2, d_model=64, ffn_hidden=176,
                            vocab_size=96, seq_len=64, mlp="swiglu"),
        "llama3-8b":   dict(n_layer=32, n_head=32, n_kv_head=8, d_model=4096, ffn_hidden=14336,
                            vocab_size=128256, seq_len=8192, mlp="swiglu"),
        "llama3-70b":  dict(n_layer=80, n_head=64, n_kv_head=8, d_model=8192, ffn_hidden=28672,
                            vocab_size=128256, seq_len=8192, mlp="swiglu"),
        "llama3-405b": dict(n_layer=126, n_head=128, n_kv_head=8, d_model=16384,
                            ffn_hidden=53248, vocab_size=128256, seq_len=8192, mlp="swiglu"),
        # mixtures of experts: a CPU-sized one; Mixtral 8x7B (Jiang et al. 2024, Table 1: dim,
        # layers, heads, KV heads, hidden_dim, vocab, 8 experts, top 2, 32K context); a
        # DeepSeek-V3-like one (DeepSeek-AI 2024, §4.2: 61 layers, h 7168, 128 heads, 256 routed
        # experts of width 2048, 8 a token, vocabulary 129280, 4K pre-training sequences) with
        # plain multi-head attention for its MLA, no shared expert and no dense first layers
        "moe-tiny":    dict(n_layer=4, n_head=4, d_model=64, vocab_size=96, seq_len=64,
                            n_expert=4, top_k=2),
        "mixtral-8x7b": dict(n_layer=32, n_head=32, n_kv_head=8, d_model=4096, ffn_hidden=14336,
                             vocab_size=32000, seq_len=32768, mlp="swiglu", n_expert=8, top_k=2),
        "deepseek-v3-like": dict(n_layer=61, n_head=128, d_model=7168, ffn_hidden=2048,
                                 vocab_size=129280, seq_len=4096, mlp="swiglu", n_expert=256,
                                 top_k=8),
    }

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        for name in ("n_kv_head", "ffn_hidden"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"GPTConfig.{name} must be None or a positive integer, got "
                                 f"{value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must divide by n_head "
                             f"({self.n_head})")
        if self.n_head % self.kv_heads:
            raise ValueError(f"GPTConfig.n_head ({self.n_head}) must divide by n_kv_head "
                             f"({self.kv_heads}): each key/value head serves a group of query "
                             "heads")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"GPTConfig.mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"GPTConfig.tie_embeddings must be True or False, got "
                             f"{self.tie_embeddings!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.n_expert, int) or isinstance(self.n_expert, bool) or \
                self.n_expert < 0:
            raise ValueError(f"GPTConfig.n_expert must be 0 (dense) or a positive integer, got "
                             f"{self.n_expert!r}")
        if self.n_expert and not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.n_expert):
            raise ValueError(f"GPTConfig.top_k must be an integer from 1 to n_expert "
                             f"({self.n_expert}), got {self.top_k!r}")
        for name in ("capacity_factor", "moe_alpha", "moe_bias_speed"):
            value, least = getattr(self, name), 0.0 if name != "capacity_factor" else 1e-9
            if not (value is None and name == "capacity_factor") and not (
                    isinstance(value, (int, float)) and not isinstance(value, bool)
                    and least <= value < math.inf):
                raise ValueError(f"GPTConfig.{name} must be a "
                                 f"{'positive' if least else 'non-negative'} number"
                                 f"{' or None' if name == 'capacity_factor' else ''}, got "
                                 f"{value!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in cls.PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def kv_dim(self) -> int:
        """k: the width of the key and of the value projection."""
        return self.kv_heads * (self.d_model // self.n_head)

    @property
    def ffn_dim(self) -> int:
        """f: the MLP's width."""
        return self.ffn_hidden or 4 * self.d_model

    @property
    def mlp_matrices(self) -> int:
        """The elements of one MLP's (one expert's) weight matrices."""
        return (3 if self.mlp == "swiglu" else 2) * self.d_model * self.ffn_dim

    @property
    def layer_matrices(self) -> int:
        """W: the elements of the weight matrices a token goes through in a layer (the 2 W flops a
        token per forward): with experts, its top_k experts' and the router's."""
        h, k = self.d_model, self.kv_dim
        mlps = self.mlp_matrices * (self.top_k if self.n_expert else 1)
        return 2 * h * h + 2 * h * k + mlps + h * self.n_expert

    @property
    def num_params(self) -> int:
        h, V, s, n = self.d_model, self.vocab_size, self.seq_len, max(self.n_expert, 1)
        mlp_biases = self.ffn_dim + h if self.mlp == "gelu" else 0
        layer = 2 * h * h + 2 * h * self.kv_dim + 6 * h + self.kv_dim + \
            n * (self.mlp_matrices + mlp_biases) + h * self.n_expert
        head = 0 if self.tie_embeddings else V * h + V
        return self.n_layer * layer + V * h + s * h + 2 * h + head

    @property
    def flops_per_token(self) -> float:
        l, h, V, s = self.n_layer, self.d_model, self.vocab_size, self.seq_len
        return 6 * l * self.layer_matrices + 12 * l * s * h + 6 * V * h


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.dropout = cfg.n_head, cfg.kv_heads, cfg.dropout
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)  # see the module docstring
        self.v = nn.Linear(cfg.d_model, cfg.kv_dim)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):                                                    # (B, T, h)
        q, k, v = (rearrange(lin(x), "b t (nh hd) -> b nh t hd", nh=heads) for lin, heads in
                   ((self.q, self.n_head), (self.k, self.n_kv_head), (self.v, self.n_kv_head)))
        return self.proj(rearrange(self.core(q, k, v), "b nh t hd -> b t (nh hd)"))  # (B, T, h)

    def core(self, q, k, v):  # q (B, nh, T, hd), k and v (B, n_kv, T, hd) -> (B, nh, T, hd):
                              #   causal softmax(q k^T / sqrt(hd)) v, query head i on kv head
                              #   i // (nh / n_kv)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0,
                                              enable_gqa=k.shape[1] != q.shape[1])


class MLP(nn.Module):
    """gelu: proj(GELU(fc x)); swiglu: proj(SiLU(gate x) * fc x), no biases."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        bias, self.swiglu = cfg.mlp == "gelu", cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=bias)

    def forward(self, x):
        if self.swiglu:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg) if not cfg.n_expert else \
            MoE(cfg.d_model, cfg.ffn_dim, cfg.n_expert, cfg.top_k, cfg.capacity_factor,
                cfg.moe_alpha, cfg.moe_bias_speed, cfg.mlp)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        y = self.mlp(self.ln2(x))
        if isinstance(self.mlp, MoE):  # (y, routing): its balance loss rides on y into backward
            y = with_balance_loss(self.mlp, *y)
        return x + self.drop(y)


class GPT(nn.Module):
    """model(idx) -> logits: idx (B, T) int64 token ids, logits (B, T, vocab_size)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=not cfg.tie_embeddings)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2l)
            if name.endswith(("proj.weight", "mlp.proj")):  # (mlp.proj: the experts')
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
