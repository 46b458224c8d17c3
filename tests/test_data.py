"""Every layout sees the same global batch; each DP rank and micro-batch takes its own slice."""
import pytest
import torch

from minipar import data


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
    text = data.CORPUS.read_text()[:5000]
    assert tok.decode(tok.encode(text).tolist()) == text
    assert len(data.corpus_tokens()) > 1_000_000 and int(data.corpus_tokens().max()) < tok.vocab_size
    assert tok.decode(tok.encode("caf\u00e9\n").tolist()) == "caf?\n"
