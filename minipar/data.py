"""Datasets, tokenizers and deterministic global batches, the same for every parallel layout.

Layout invariance starts here: the global batch of step k depends only on (data, seed, k, global
batch size, sequence length), never on how many ranks there are. Each data-parallel rank then takes
a contiguous slice of rows, and each micro-batch a slice of that:

    global batch (B rows) = [ dp rank 0 | dp rank 1 | ... ],  dp rank d = [ mb 0 | mb 1 | ... ]

(equal slices: `shard`; uneven ones, a heterogeneous plan's ParallelConfig.dp_shares: `shard_rows`).

The data is a value, `Dataset(source, tokenizer, vocab)`, made and checked once by `prepare` in the
calling process and sent to every rank, which rebuilds the same token ids from it. Sources:
  "shakespeare"  the bundled corpus (data/shakespeare.txt, 13 plays from Project Gutenberg);
  a path         your own text: a .txt file, or a folder (every *.txt under it, sorted by path,
                 joined by a blank line), read as UTF-8 with undecodable bytes replaced;
  "synthetic"    arithmetic sequences mod V with a random start and stride per row: no file needed,
                 and learnable in context, so a falling loss means the model works.
Tokenizers: "char" (CharTokenizer, 96 ids) or "bpe" (byte-level BPE, trained by `prepare` with the
`tokenizers` library; its JSON travels in the Dataset, so ranks never retrain).

Held-out split: of a text's token ids, the first 90% are "train" and the last 10% "val", two
contiguous blocks, so no window of either split holds a token of the other:

    tokens = [ train (90%) ........................................ | val (10%) ....... ]

Windows start at random offsets drawn from (seed, step) inside their split. Synthetic "val" rows
come from the same generator on another stream (a seed offset), so they differ from training's.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SOURCES = ("shakespeare", "synthetic")
TOKENIZERS = ("char", "bpe")
SPLITS = ("train", "val")
VAL_PERCENT = 10      # the last 10% of a text's tokens are "val"
VAL_STREAM = 1 << 31  # added to the generator's seed for "val": a stream training never draws (the
                      #   CPU generator keeps 32 bits of a seed, so the offset must lie below 2**32)
MIN_BPE_VOCAB = 257   # the 256 byte tokens and at least one merge


def bundled(name: str) -> Path:
    """A folder that ships with minipar, `name` "data" or "notebooks": the repository's top-level
    folder in a checkout (editable install, or PYTHONPATH), else the copy installed inside the
    package as minipar/bundled/<name> (pyproject's package-dir maps one onto the other)."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / name).is_dir():
        return root / name
    return Path(str(resources.files("minipar") / "bundled" / name))


def corpus_path() -> Path:
    """The bundled Shakespeare corpus (see `bundled`)."""
    return bundled("data") / "shakespeare.txt"


def lessons_dir() -> Path:
    """The bundled notebooks: the repository's notebooks/ or the installed copy (see `bundled`)."""
    return bundled("notebooks")


class CharTokenizer:
    """Printable ASCII (32..126) and newline: 96 token ids; anything else maps to '?'."""
    vocab_size = 96

    def encode(self, text: str) -> torch.Tensor:
        ids = [0 if c == "\n" else ord(c) - 31 if 32 <= ord(c) <= 126 else ord("?") - 31
               for c in text]
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join("\n" if i == 0 else chr(int(i) + 31) for i in ids)


@dataclass(frozen=True)
class Dataset:
    """What to train on, as a value: picklable and hashable, sent to every rank, which rebuilds the
    same token ids from it. Make one with `prepare`, which checks the source and trains the BPE."""
    source: str                # "shakespeare", "synthetic", or an absolute path (.txt file, folder)
    tokenizer: str = "char"    # "char" (CharTokenizer, 96 ids) or "bpe"
    vocab: str | None = field(default=None, repr=False)  # the BPE as JSON (Tokenizer.to_str());
                                                        #   None for char

    def __post_init__(self):
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if (self.tokenizer == "bpe") != (self.vocab is not None):
            raise ValueError("Dataset.vocab is the trained BPE's JSON, given with tokenizer='bpe' "
                             "only: make the Dataset with data.prepare(source, 'bpe', vocab_size)")

    @property
    def vocab_size(self) -> int | None:
        """Token ids the tokenizer makes: 96 for char, the BPE's vocabulary; None for synthetic
        (its ids are 0..V-1 for the model's V)."""
        if self.source == "synthetic":
            return None
        return _bpe(self.vocab).get_vocab_size() if self.vocab else CharTokenizer.vocab_size

    @property
    def fingerprint(self) -> str | None:
        """A short digest of the BPE vocabulary (None for char): equal exactly when the token ids
        mean the same, what a resumed run must keep."""
        return hashlib.sha256(self.vocab.encode()).hexdigest()[:12] if self.vocab else None

    def encode(self, text: str) -> torch.Tensor:
        if self.vocab:
            return torch.tensor(_bpe(self.vocab).encode(text).ids, dtype=torch.int64)
        return CharTokenizer().encode(text)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        return _bpe(self.vocab).decode(ids) if self.vocab else CharTokenizer().decode(ids)

    def tokens(self, split: str = "train") -> torch.Tensor:
        """The token ids of `split`, "train" (the first 90%) or "val" (the last 10%); the text is
        read and encoded once per process. Not for synthetic data, which has no corpus."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if self.source == "synthetic":
            raise ValueError("synthetic data has no corpus: its rows come from global_batch")
        ids = _encoded(self)
        cut = len(ids) - len(ids) * VAL_PERCENT // 100
        return ids[:cut] if split == "train" else ids[cut:]


def prepare(source: str, tokenizer: str = "char", vocab_size: int | None = None) -> Dataset:
    """The Dataset of `source` ("shakespeare", "synthetic", or a path to a .txt file or a folder),
    checked before any worker starts (a bad one raises a one-line ValueError). With "bpe" this
    trains the byte-level BPE of `vocab_size` tokens on the text, once, here."""
    if not isinstance(source, (str, Path)):
        raise ValueError(f"data must be one of {SOURCES} or a path to a .txt file or a folder, "
                         f"got {source!r}")
    source = str(source)
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    if source == "synthetic" and tokenizer != "char":
        raise ValueError("synthetic data has no text to train a tokenizer on: use the char "
                         "tokenizer or a text source")
    bpe_size_ok = isinstance(vocab_size, int) and not isinstance(vocab_size, bool) \
        and vocab_size >= MIN_BPE_VOCAB
    if tokenizer == "bpe" and not bpe_size_ok:
        raise ValueError(f"the bpe tokenizer needs vocab_size >= {MIN_BPE_VOCAB} (256 bytes and at "
                         f"least one merge), got {vocab_size!r}: pass a larger --vocab-size")
    if source == "synthetic":
        return Dataset(source)
    source = source if source == "shakespeare" else _as_path(source)
    text = read_text(source)  # checks that the file or folder holds text
    if tokenizer == "char":
        return Dataset(source)
    return Dataset(source, "bpe", train_bpe(text, vocab_size))


def for_run(data, tokenizer: str, vocab_size: int | None, kept: dict | None = None) -> Dataset:
    """A training run's Dataset: `data` if it is one, else `prepare`'s, except that a run resumed
    from a checkpoint keeps the checkpoint's (`kept`, a Dataset as a dict) when it names the same
    source and tokenizer, so its token ids mean what they meant (a BPE trained again may differ)."""
    if isinstance(data, Dataset):
        return data
    if kept:
        kept = Dataset(**kept)
        if kept.tokenizer == tokenizer and kept.source == prepare(data).source:
            return kept
    return prepare(data, tokenizer, vocab_size)


def train_bpe(text: str, vocab_size: int) -> str:
    """A byte-level BPE of at most `vocab_size` tokens trained on `text`, as JSON. Deterministic:
    the same text and size give the same merges. Fewer tokens when the text runs out of pairs."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    return tok.to_str()


def check(data: Dataset, vocab_size: int, seq_len: int) -> None:
    """ValueError unless a model of `vocab_size` token ids and windows of `seq_len` fit `data`:
    the model must know every id the tokenizer makes, and each split must hold one window of
    seq_len + 1 tokens (inputs and the targets shifted by one)."""
    if data.vocab_size is not None and vocab_size < data.vocab_size:
        raise ValueError(f"the {data.tokenizer} tokenizer makes {data.vocab_size} token ids but "
                         f"the model's vocab_size is {vocab_size}: pass --vocab-size "
                         f"{data.vocab_size} or more")
    if data.source == "synthetic":
        return
    for split in SPLITS:
        n = len(data.tokens(split))
        if n < seq_len + 1:
            raise ValueError(f"the {split} split of {data.source} has {n} tokens, too few for one "
                             f"window of seq_len + 1 = {seq_len + 1}: use more text or a smaller "
                             "--seq-len")


def global_batch(data: Dataset | str, step: int, batch: int, seq_len: int, vocab_size: int,
                 seed: int = 0, split: str = "train"):
    """(inputs, targets) of step `step` of `split`: two int64 tensors (batch, seq_len), targets
    shifted by one. `data` is a Dataset or a source string (`prepare(data)`, the char tokenizer)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    data = _as_dataset(data) if isinstance(data, str) else data
    stream = seed * 1_000_003 + step + (VAL_STREAM if split == "val" else 0)
    gen = torch.Generator().manual_seed(stream)
    if data.source == "synthetic":
        start = torch.randint(0, vocab_size, (batch, 1), generator=gen)
        stride = torch.randint(1, max(2, vocab_size // 4), (batch, 1), generator=gen)
        rows = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    else:
        check(data, vocab_size, seq_len)
        tokens = data.tokens(split)
        offsets = torch.randint(0, len(tokens) - seq_len, (batch,), generator=gen)
        rows = torch.stack([tokens[o: o + seq_len + 1] for o in offsets.tolist()])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@functools.lru_cache(maxsize=4)
def read_text(source: str) -> str:
    """The text of "shakespeare" or of a path (see the module docstring); ValueError if it has
    none. Read once per process (by prepare, which checks it, and by each rank)."""
    if source == "shakespeare":
        path = corpus_path()
        if not path.is_file():
            raise FileNotFoundError(f"bundled corpus missing: {path} (make it with python "
                                    f"{path.parent / 'prepare_shakespeare.py'})")
        return path.read_text(encoding="utf-8")
    path = Path(source)
    if not path.exists():
        raise ValueError(f"data path {source} does not exist: give a .txt file or a folder of them")
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"data folder {source} has no .txt files: add some or give a .txt file")
    text = "\n\n".join(_decode(f).rstrip("\n") for f in files)
    if not text.strip():
        raise ValueError(f"data path {source} is empty: give a file with text in it")
    return text + "\n"


def _decode(path: Path) -> str:
    """The text of one file as UTF-8, stray bad bytes replaced; a file that is not text (a NUL byte,
    or over a tenth undecodable) raises."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
    if b"\x00" in raw or bad * 10 > len(raw):
        raise ValueError(f"data file {path} cannot be decoded as UTF-8 text ({bad} bad bytes of "
                         f"{len(raw)}): give a text file")
    return text


def _as_path(source: str) -> str:
    """A path source made absolute (ranks may start elsewhere); an unknown name raises."""
    path = Path(source).expanduser()
    if not path.exists() and path.suffix != ".txt" and len(path.parts) == 1:
        raise ValueError(f"data must be one of {SOURCES} or a path to a .txt file or a folder, "
                         f"got {source!r}")
    return str(path.resolve())


@functools.lru_cache(maxsize=4)
def _as_dataset(source: str) -> Dataset:
    return prepare(source)  # once per process: global_batch(str) is called every step


@functools.lru_cache(maxsize=4)
def _bpe(vocab: str) -> Tokenizer:
    return Tokenizer.from_str(vocab)


@functools.lru_cache(maxsize=4)
def _encoded(data: Dataset) -> torch.Tensor:
    return data.encode(read_text(data.source))


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
