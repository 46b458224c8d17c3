"""Tokenizer and deterministic global batches, the same for every parallel layout.

Layout invariance starts here: the global batch of step k depends only on (data, seed, k, global
batch size, sequence length), never on how many ranks there are. Each data-parallel rank then takes
a contiguous slice of rows, and each micro-batch a slice of that:

    global batch (B rows) = [ dp rank 0 | dp rank 1 | ... ],  dp rank d = [ mb 0 | mb 1 | ... ]

(equal slices: `shard`; uneven ones, a heterogeneous plan's ParallelConfig.dp_shares: `shard_rows`).

Two sources:
  "shakespeare"  the bundled corpus (data/shakespeare.txt, 13 plays from Project Gutenberg), read
                 as characters; windows start at random offsets drawn from (seed, step).
  "synthetic"    arithmetic sequences mod V with a random start and stride per row: no file needed,
                 and learnable in context, so a falling loss means the model works.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

CORPUS = Path(__file__).resolve().parents[1] / "data" / "shakespeare.txt"
SOURCES = ("shakespeare", "synthetic")


class CharTokenizer:
    """Printable ASCII (32..126) and newline: 96 token ids; anything else maps to '?'."""
    vocab_size = 96

    def encode(self, text: str) -> torch.Tensor:
        ids = [0 if c == "\n" else ord(c) - 31 if 32 <= ord(c) <= 126 else ord("?") - 31
               for c in text]
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join("\n" if i == 0 else chr(int(i) + 31) for i in ids)


@functools.lru_cache(maxsize=1)
def corpus_tokens() -> torch.Tensor:
    """The bundled corpus as token ids (read and encoded once per process)."""
    if not CORPUS.exists():
        raise FileNotFoundError(f"bundled corpus missing: {CORPUS} (make it with "
                                "data/prepare_shakespeare.py)")
    return CharTokenizer().encode(CORPUS.read_text(encoding="ascii"))


def global_batch(source: str, step: int, batch: int, seq_len: int, vocab_size: int, seed: int = 0):
    """(inputs, targets) of step `step`: two int64 tensors (batch,
    seq_len), targets shifted by one."""
    if source not in SOURCES:
        raise ValueError(f"data must be one of {SOURCES}, got {source!r}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if source == "synthetic":
        start = torch.randint(0, vocab_size, (batch, 1), generator=gen)
        stride = torch.randint(1, max(2, vocab_size // 4), (batch, 1), generator=gen)
        rows = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    else:
        tokens = corpus_tokens()
        if vocab_size < CharTokenizer.vocab_size:
            raise ValueError(f"the shakespeare corpus needs vocab_size >= 96, got {vocab_size}")
        offsets = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
        rows = torch.stack([tokens[o: o + seq_len + 1] for o in offsets.tolist()])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def shard(rows: torch.Tensor, dp_rank: int, dp: int, microbatch: int = 0, microbatches: int = 1):
    """This DP rank's micro-batch `microbatch` of a global batch:
    contiguous rows, equal sizes, a copy."""
    if rows.shape[0] % (dp * microbatches):
        raise ValueError(f"global batch {rows.shape[0]} does not divide by dp*microbatches = "
                         f"{dp * microbatches}")
    per_mb = rows.shape[0] // (dp * microbatches)
    start = (dp_rank * microbatches + microbatch) * per_mb
    return rows[start: start + per_mb].clone()  # its own storage: a view would keep the whole batch


def shard_rows(rows: torch.Tensor, start: int, count: int, microbatch: int = 0,
               microbatches: int = 1):
    """Uneven data parallelism (ParallelConfig.dp_shares): micro-batch `microbatch` of the `count`
    rows from `start` that one DP rank takes, cut into `microbatches`
    equal micro-batches; a copy."""
    if count % microbatches or start < 0 or start + count > rows.shape[0]:
        raise ValueError(f"rows [{start}, {start + count}) of a batch of {rows.shape[0]} do not "
                         "cut into "
                         f"{microbatches} equal micro-batches")
    per_mb = count // microbatches
    return rows[start + microbatch * per_mb: start + (microbatch + 1) * per_mb].clone()
