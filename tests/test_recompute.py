"""Activation recomputation (recompute.py): same training, less memory as predicted, one more forward.

"full" keeps each layer's input only and runs the layer's forward again in backward; "selective"
recomputes the attention core, which with fused attention saves only its log-sum-exp.
"""
import pytest
import torch
from reference import assert_same_training
from torch.utils._python_dispatch import TorchDispatchMode

import minipar
from minipar.config import ParallelConfig
from minipar.model import GPT, cross_entropy
from minipar.recompute import apply_recompute

TINY = minipar.GPTConfig.preset("tiny")
KW = dict(steps=3, global_batch=8, lr=1e-3, weight_decay=0.1, seed=0, return_state=True)
LAYOUTS = [ParallelConfig(recompute="full"), ParallelConfig(recompute="selective"),
           ParallelConfig(tp=2, sequence_parallel=True, recompute="full"), ParallelConfig(tp=2, recompute="selective"),
           ParallelConfig(pp=2, microbatches=2, recompute="full"), ParallelConfig(dp=2, zero=1, recompute="full")]


@pytest.fixture(scope="module")
def reference():
    return minipar.train(TINY, ParallelConfig(), **KW)


@pytest.mark.parametrize("par", LAYOUTS, ids=[p.label for p in LAYOUTS])
def test_recomputation_trains_the_same_model_with_the_predicted_memory(par, reference):
    res = minipar.train(TINY, par, **KW)
    assert_same_training(res, reference)
    assert [m["activations"] for m in res.peak_memory] == [m["activations"] for m in res.predicted_memory]
    if par.recompute == "full":  # a layer keeps its input only: s b h e (/t with SP) instead of ~16 s b h e
        assert max(m["activations"] for m in res.peak_memory) < 0.25 * reference.peak_memory[0]["activations"]


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def _matmuls(mode: str, forward_only: bool = False) -> int:
    torch.manual_seed(0)
    model = apply_recompute(GPT(TINY), mode)
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    with _Matmuls() as count:
        loss = cross_entropy(model(x), x)
        if not forward_only:
            loss.backward()
    return count.calls


def test_full_recomputation_costs_one_more_forward_of_the_layers():
    layer_forward = 6 * TINY.n_layer  # q, k, v, proj, fc, proj: six matmuls a layer
    assert _matmuls("full", forward_only=True) == _matmuls("none", forward_only=True) == layer_forward + 1  # + head
    # backward runs each layer's forward again, up to the last matmul: the MLP's output projection
    # saves its input, not its output, so the non-reentrant checkpoint stops before it
    assert _matmuls("full") == _matmuls("none") + 5 * TINY.n_layer
    assert _matmuls("selective") == _matmuls("none")  # the attention core is one fused kernel, not a matmul


def test_bad_recompute_mode():
    with pytest.raises(ValueError, match="recompute must be one of"):
        ParallelConfig(recompute="some")
    with pytest.raises(ValueError, match="recompute must be one of"):
        apply_recompute(GPT(TINY), "some")
