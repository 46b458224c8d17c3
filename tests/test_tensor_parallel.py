"""Megatron tensor parallelism (tensor_parallel.py) against the single-device model.

Layers: each parallel layer's output and input and weight gradients equal the part of the
single-device layer's that the rank holds, t = 2, 3, 4, with and without sequence parallelism.
Training: losses and final weights equal the single-process run for tp 2, 3, 4, with SP, and with dp.
Costs: the collectives are counted exactly, bytes equal `traffic.tp`, activation memory
per layer equals Korthikanti et al.'s formula less what minipar does not store, and the full
vocabulary never appears in a tensor.
"""
import pytest
import workers_tp
from reference import assert_same_training

import minipar
from minipar import memory, tensor_parallel, traffic
from minipar.config import ParallelConfig

TINY = minipar.GPTConfig.preset("tiny")          # 4 layers, 4 heads, h 64, V 96, s 64
THREE = minipar.GPTConfig(n_layer=2, n_head=6, d_model=48, vocab_size=96, seq_len=24)  # tp = 3 divides
STEPS, BATCH = 3, 8
KW = dict(steps=STEPS, global_batch=BATCH, lr=1e-3, weight_decay=0.1, seed=0, return_state=True)


@pytest.mark.parametrize("t", [2, 3, 4])
def test_each_layer_equals_the_single_device_layer(t):
    errors = minipar.launch(workers_tp.all_layer_errors, t, timeout=120)
    worst = {k: max(rank[k] for rank in errors) for k in errors[0]}
    assert len(worst) == 2 * (4 + 4 + 9 + 6 + 2)  # both modes: outputs, input and weight gradients
    assert max(worst.values()) < 1e-5, {k: v for k, v in worst.items() if v >= 1e-5}


@pytest.mark.parametrize("t", [2, 3, 4])
def test_vocab_parallel_cross_entropy_never_forms_the_full_logits(t):
    for rank in minipar.launch(workers_tp.cross_entropy_check, t, timeout=60):
        assert rank["loss"] == pytest.approx(rank["ref"], rel=1e-6) and rank["grad"] < 1e-6
        assert 96 // t in rank["widths"] and 96 not in rank["widths"]  # logit slices, never the whole


@pytest.fixture(scope="module")
def reference():
    return {cfg: minipar.train(cfg, ParallelConfig(), **KW) for cfg in (TINY, THREE)}


LAYOUTS = [(TINY, ParallelConfig(tp=2)), (TINY, ParallelConfig(tp=2, sequence_parallel=True)),
           (TINY, ParallelConfig(tp=4)), (TINY, ParallelConfig(tp=4, sequence_parallel=True)),
           (THREE, ParallelConfig(tp=3, sequence_parallel=True)),
           (TINY, ParallelConfig(tp=2, dp=2)), (TINY, ParallelConfig(tp=2, dp=2, sequence_parallel=True)),
           (TINY, ParallelConfig(tp=2, dp=2, zero=1, microbatches=2, collectives="torch"))]


@pytest.mark.parametrize("cfg,par", LAYOUTS, ids=[par.label for _, par in LAYOUTS])
def test_layout_invariance_and_traffic(cfg, par, reference):
    res = minipar.train(cfg, par, **KW)
    assert_same_training(res, reference[cfg])
    l, m = cfg.n_layer, par.microbatches
    expected = traffic.tp(cfg, par, BATCH)
    tp_kinds = {k: v for k, v in res.comm_bytes[0].items() if k in expected}
    if par.dp == 1:  # the dp group's reductions share the names; they are tested in test_data_parallel
        assert tp_kinds == pytest.approx({k: STEPS * v for k, v in expected.items()}, rel=1e-12)
    calls = res.comm_calls[0]
    if par.sequence_parallel:  # per micro-batch: 4l + 2 reduce-scatters, 6l + 3 gathers + the loss's maxima
        assert calls["reduce_scatter"] == STEPS * m * (4 * l + 2)
        assert calls["all_gather"] == STEPS * m * (6 * l + 4)
        assert calls["all_reduce"] == STEPS * (2 * m + 1 + (par.dp > 1))  # loss sums, partial grads, DP
    elif par.collectives == "minipar":  # 2 a layer each way, embedding, head, the loss's two sums
        assert calls == {"all_reduce": STEPS * (m * (4 * l + 4) + (par.dp > 1)), "all_gather": STEPS * m}
    for predicted, measured in zip(res.predicted_memory, res.peak_memory):
        extra = measured.pop("optimizer") - predicted.pop("optimizer")
        assert predicted == measured and 0 <= extra <= 4 * 2 * len(res.state_dict)  # + Adam's step counters


@pytest.mark.parametrize("sp", [False, True], ids=["no SP", "SP"])
def test_full_recomputation_repeats_the_forward_collectives_it_needs(sp, reference):
    par = ParallelConfig(tp=2, sequence_parallel=sp, recompute="full")
    res = minipar.train(TINY, par, **KW)
    assert_same_training(res, reference[TINY])
    plain = traffic.tp(TINY, par.replace(recompute="none"), BATCH)
    expected = traffic.tp(TINY, par, BATCH)
    assert res.comm_bytes[0] == pytest.approx({k: STEPS * v for k, v in expected.items()}, rel=1e-12)
    x, l = BATCH * TINY.seq_len * TINY.d_model * 4, TINY.n_layer  # one micro-batch; ring (t-1)/t = 1/2
    more = {"reduce_scatter": l * x / 2, "all_gather": 2 * l * x / 2} if sp else {"all_reduce": l * x}
    assert {k: expected[k] - plain[k] for k in more} == pytest.approx(more, rel=1e-12)


def test_two_all_reduces_per_layer_each_way():
    """Bytes of the layers' all-reduces per layer per micro-batch: 8 b s h e (t-1)/t (docs/references.md)."""
    par, deeper = ParallelConfig(tp=2), TINY.replace(n_layer=6)
    per_layer = (traffic.tp(deeper, par, BATCH)["all_reduce"]
                 - traffic.tp(TINY, par, BATCH)["all_reduce"]) / 2
    b, s, h, e, t = BATCH, TINY.seq_len, TINY.d_model, 4, 2
    assert per_layer == 8 * b * s * h * e * (t - 1) / t


@pytest.mark.parametrize("sp", [False, True])
def test_activation_memory_per_layer_follows_korthikanti(sp):
    """Measured per layer (the difference of a 4- and a 2-layer model) against Table 2's formula."""
    par = ParallelConfig(tp=2, sequence_parallel=sp)
    shallow = TINY.replace(n_layer=2)
    measured = [minipar.train(cfg, par, steps=1, global_batch=4).peak_memory[0]["activations"]
                for cfg in (TINY, shallow)]
    per_layer = (measured[0] - measured[1]) / 2
    s, b, h, a, t, cut = TINY.seq_len, 4, TINY.d_model, TINY.n_head, 2, 2 if sp else 1
    paper = memory.korthikanti(TINY.replace(n_layer=1), b, element_bytes=4, t=t, sp=sp)
    # the paper less what minipar does not store: dropout masks, the attention matrix (fused SDPA);
    # plus what it does: LayerNorm statistics and the attention's log-sum-exp (fp32)
    adjusted = paper - 2 * s * b * h / cut - 9 * a * s * s * b / t + 4 * s * b * 4 / cut + 4 * a * s * b / t
    assert per_layer == adjusted
    full = memory.korthikanti(TINY.replace(n_layer=1), b, element_bytes=4)
    assert per_layer < (0.35 if sp else 0.6) * full  # what TP, and SP on top, save


def test_bad_tensor_parallel_layouts_fail_before_any_process():
    with pytest.raises(ValueError, match=r"tp \(3\) must divide the model's n_head \(4\)"):
        minipar.train(TINY, ParallelConfig(tp=3))
    with pytest.raises(ValueError, match=r"tp \(4\) must divide the model's vocab_size \(90\)"):
        minipar.train(TINY.replace(vocab_size=90), ParallelConfig(tp=4))
    with pytest.raises(ValueError, match=r"seq_len \(30\) to divide by tp \(4\)"):
        minipar.train(TINY.replace(seq_len=30), ParallelConfig(tp=4, sequence_parallel=True))
    with pytest.raises(ValueError, match="sequence_parallel=True needs tp > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"tp \(5\) must divide the model's n_head"):  # apply_tp checks too
        tensor_parallel.apply_tp(minipar.GPT(THREE), tensor_parallel.TPGroup(None, 5, 0))
    # the hidden size needs no rule of its own: n_head divides it, so a tp that divides n_head does too


def test_tp_through_the_cli(tmp_path, capsys):
    from minipar.__main__ import main
    main(["train", "--tp", "2", "--sequence-parallel", "--steps", "2", "--global-batch", "4", "--plot", "",
          "--sample", "10"])
    out, _ = capsys.readouterr()
    assert "layout: tp=2 sequence_parallel=True" in out
