"""Every layout sees the same global batch; each DP rank and micro-batch takes its own slice. Data
is a value: prepare checks it up front, trains the BPE once, and ranks rebuild the same tokens."""
import pickle

import pytest
import torch

import minipar
from minipar import data

EXTRA = "caf\u00e9, na\u00efve \u2013 \u201cquoted\u201d  two  spaces\n\n\ttab\n"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A small corpus (the start of the bundled one and some non-ASCII), so a BPE trains fast."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(data.corpus_path().read_text()[:30_000] + EXTRA, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bpe(text_file):
    return data.prepare(str(text_file), "bpe", vocab_size=300)


@pytest.mark.parametrize("source", data.SOURCES)
def test_global_batch_depends_only_on_seed_and_step(source):
    x1, y1 = data.global_batch(source, step=3, batch=8, seq_len=16, vocab_size=96, seed=1)
    x2, y2 = data.global_batch(source, step=3, batch=8, seq_len=16, vocab_size=96, seed=1)
    x3, _ = data.global_batch(source, step=4, batch=8, seq_len=16, vocab_size=96, seed=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert x1.shape == y1.shape == (8, 16) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    assert 0 <= x1.min() and x1.max() < 96


@pytest.mark.parametrize("dp,microbatches", [(1, 1), (2, 2), (3, 1), (4, 3), (1, 12)])
def test_slices_tile_the_global_batch_in_order(dp, microbatches):
    x, _ = data.global_batch("synthetic", 0, batch=12, seq_len=8, vocab_size=96)
    pieces = [data.shard(x, d, dp, m, microbatches) for d in range(dp) for m in range(microbatches)]
    assert {p.shape[0] for p in pieces} == {12 // (dp * microbatches)}
    assert torch.equal(torch.cat(pieces), x)


def test_uneven_split_is_refused():
    x, _ = data.global_batch("synthetic", 0, batch=10, seq_len=8, vocab_size=96)
    with pytest.raises(ValueError, match="does not divide by dp\\*microbatches = 4"):
        data.shard(x, 0, 4)


def test_tokenizer_round_trips_the_corpus():
    tok = data.CharTokenizer()
    text = data.corpus_path().read_text()[:5000]
    assert tok.decode(tok.encode(text).tolist()) == text
    train = data.Dataset("shakespeare").tokens("train")
    assert len(train) > 1_000_000 and int(train.max()) < tok.vocab_size
    assert tok.decode(tok.encode("caf\u00e9\n").tolist()) == "caf?\n"
    assert data.lessons_dir().joinpath("00_collectives.ipynb").is_file()


def test_bpe_round_trips_text_and_trains_the_same_merges(bpe, text_file):
    assert bpe.tokenizer == "bpe" and 256 < bpe.vocab_size <= 300
    for text in (EXTRA, "ROMEO: what light\n", text_file.read_text(encoding="utf-8")[:2000]):
        ids = bpe.encode(text)
        assert ids.dtype == torch.int64 and int(ids.max()) < bpe.vocab_size
        assert bpe.decode(ids) == text and bpe.decode(ids.tolist()) == text
    assert len(bpe.encode(EXTRA * 20)) < len((EXTRA * 20).encode())  # merges: fewer ids than bytes
    assert data.prepare(str(text_file), "bpe", vocab_size=300) == bpe  # deterministic training
    assert "vocab" not in repr(bpe)  # the JSON stays out of messages


def test_a_folder_is_its_txt_files_in_path_order(tmp_path, monkeypatch):
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "b" / "2.txt").write_text("second\n\n")
    (tmp_path / "a" / "deep" / "1.txt").write_text("first\n")
    (tmp_path / "notes.md").write_text("not text for training")
    (tmp_path / "z.txt").write_bytes(b"last, with a stray \xff byte")
    ds = data.prepare(str(tmp_path))
    assert ds == data.Dataset(str(tmp_path)) and ds.vocab_size == 96
    assert data.read_text(ds.source) == "first\n\nsecond\n\nlast, with a stray \ufffd byte\n"
    monkeypatch.chdir(tmp_path)  # a relative path is made absolute: ranks may start elsewhere
    assert data.prepare("z.txt").source == str(tmp_path / "z.txt")


def _bad_inputs(tmp):
    (tmp / "empty.txt").write_text("")
    (tmp / "no_txt").mkdir()
    (tmp / "no_txt" / "a.md").write_text("words")
    (tmp / "blank").mkdir()
    (tmp / "blank" / "a.txt").write_text("\n\n")
    (tmp / "model.bin").write_bytes(bytes(range(256)))
    (tmp / "latin.txt").write_bytes(b"\xe9\xe8\xff\xfe" * 50)
    return {
        "unknown source": (("shakespear",), "data must be one of .* got 'shakespear'"),
        "not a source": ((None,), "data must be one of"),
        "missing path": ((str(tmp / "missing.txt"),), "missing.txt does not exist"),
        "empty file": ((str(tmp / "empty.txt"),), "empty.txt is empty"),
        "blank folder": ((str(tmp / "blank"),), "blank is empty"),
        "no txt files": ((str(tmp / "no_txt"),), "no_txt has no .txt files"),
        "binary": ((str(tmp / "model.bin"),), "model.bin cannot be decoded"),
        "not utf-8": ((str(tmp / "latin.txt"),), "latin.txt cannot be decoded"),
        "unknown tokenizer": (("shakespeare", "wordpiece"), "tokenizer must be one of"),
        "bpe too small": (("shakespeare", "bpe", 256), "vocab_size >= 257 .* got 256: .*--vocab"),
        "bpe no size": (("shakespeare", "bpe"), "vocab_size >= 257 .* got None"),
        "bpe synthetic": (("synthetic", "bpe", 300), "synthetic data has no text"),
    }


@pytest.mark.parametrize("case", ["unknown source", "not a source", "missing path", "empty file",
                                  "blank folder", "no txt files", "binary", "not utf-8",
                                  "unknown tokenizer", "bpe too small", "bpe no size",
                                  "bpe synthetic"])
def test_prepare_refuses_bad_input_in_one_line(case, tmp_path):
    args, message = _bad_inputs(tmp_path)[case]
    with pytest.raises(ValueError, match=message) as err:
        data.prepare(*args)
    assert "\n" not in str(err.value)


def test_check_names_the_vocab_flag_and_the_short_split(bpe, tmp_path):
    with pytest.raises(ValueError, match=f"makes {bpe.vocab_size} token ids but the model's "
                                         f"vocab_size is 96: pass --vocab-size {bpe.vocab_size}"):
        data.check(bpe, 96, 16)
    data.check(bpe, bpe.vocab_size, 16)
    short = tmp_path / "short.txt"
    short.write_text("x" * 99)  # 100 tokens with the final newline: val holds 10
    ds = data.prepare(str(short))
    data.check(ds, 96, 9)
    message = f"val split of {short} has 10 tokens, too few for one window of seq_len \\+ 1 = 11"
    with pytest.raises(ValueError, match=message):
        data.check(ds, 96, 10)
    with pytest.raises(ValueError, match=message):
        data.global_batch(ds, 0, 2, 10, 96, split="val")
    with pytest.raises(ValueError, match="model's vocab_size is 64"):
        data.global_batch("shakespeare", 0, 2, 8, 64)


def _located(windows: torch.Tensor, rows: torch.Tensor) -> set:
    """Every start offset in the corpus at which one of `rows` (seq_len + 1 tokens each) lies."""
    return {int(i) for row in rows for i in (windows == row).all(1).nonzero()}


def test_train_and_val_windows_come_from_their_own_block(tmp_path):
    letters = torch.randint(0, 26, (4000,), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "random.txt"
    path.write_text("".join(chr(97 + int(i)) for i in letters))  # 17-letter windows are unique
    ds = data.prepare(str(path))
    full = ds.encode(data.read_text(ds.source))
    train, val = ds.tokens("train"), ds.tokens("val")
    cut = len(full) - len(full) // 10
    assert torch.equal(torch.cat([train, val]), full) and len(train) == cut
    windows, seq = full.unfold(0, 17, 1), 16
    for step in range(5):
        x, y = data.global_batch(ds, step, 8, seq, 96, split="val")
        starts = _located(windows, torch.cat([x, y[:, -1:]], 1))
        assert starts and min(starts) >= cut  # every val window lies in the last 10%
        x, y = data.global_batch(ds, step, 8, seq, 96, split="train")
        starts = _located(windows, torch.cat([x, y[:, -1:]], 1))
        assert starts and max(starts) + seq + 1 <= cut  # every train window ends before it


def test_synthetic_val_rows_differ_from_training_rows():
    for step in range(3):
        train, _ = data.global_batch("synthetic", step, 8, 16, 96, seed=2)
        val, _ = data.global_batch("synthetic", step, 8, 16, 96, seed=2, split="val")
        again, _ = data.global_batch("synthetic", step, 8, 16, 96, seed=2, split="val")
        assert torch.equal(val, again) and not (val == train).all(1).any()
    with pytest.raises(ValueError, match="split must be one of"):
        data.global_batch("synthetic", 0, 8, 16, 96, split="test")


def test_ranks_rebuild_the_same_batches_from_a_pickled_dataset(bpe):
    """What train does: the Dataset is pickled to each rank, which re-reads and re-encodes the
    text itself (a fresh process: nothing cached) and must draw the very same batch."""
    assert pickle.loads(pickle.dumps(bpe)) == bpe
    here = data.global_batch(bpe, 3, 4, 16, bpe.vocab_size, seed=1, split="val")
    ranks = minipar.launch(data.global_batch, 2, bpe, 3, 4, 16, bpe.vocab_size, 1, "val",
                           timeout=120)
    for x, y in ranks:
        assert torch.equal(x, here[0]) and torch.equal(y, here[1])
