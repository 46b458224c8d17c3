"""The single-device GPT: shapes, parameter count against the formula, causality."""
import torch

from minipar import GPT, GPTConfig
from minipar.model import cross_entropy

TINY = GPTConfig.preset("tiny")


def test_parameter_count_matches_the_formula():
    for cfg in (TINY, GPTConfig.preset("small-cpu"), TINY.replace(n_layer=3, vocab_size=50)):
        assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_params
    # Narayanan et al. eq. 2 counts a tied embedding and a key bias; we untie the head (+V*h + V),
    # drop the key bias (-h a layer), and count the final LayerNorm (+2h)
    cfg = GPTConfig.preset("gpt2-small")
    l, h, V, s = cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len
    narayanan = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    assert abs(cfg.num_params - (narayanan + V * h + V - l * h + 2 * h)) < 1


def test_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    logits = model(idx)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    loss = cross_entropy(logits, idx)
    assert abs(loss.item() - torch.log(torch.tensor(96.0)).item()) < 0.1  # near uniform at init


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % TINY.vocab_size
    assert torch.allclose(model(idx)[0, :10], model(changed)[0, :10])
    assert not torch.allclose(model(idx)[0, 10:], model(changed)[0, 10:])


def test_same_seed_same_model():
    torch.manual_seed(7)
    a = GPT(TINY).state_dict()
    torch.manual_seed(7)
    b = GPT(TINY).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
