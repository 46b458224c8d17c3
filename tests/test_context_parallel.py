"""Context parallelism (context_parallel.py): causal attention over a sequence split across ranks.

Each method's output and its q, k, v gradients equal the single-device attention's, restricted to
the rank's tokens (float64, so to rounding), at cp 2 and 3, lengths that do not divide evenly, with
grouped-query attention, balanced and contiguous; the bytes each rank sends equal `sent`'s
formulas; the balanced split evens out the causal work. Training: losses and weights equal the
single-process run for every method, with dp, tp (and sequence parallelism), ZeRO 1-3,
micro-batches, pipelines (interleaved too) and recomputation, cp 2 and 3 (64 tokens in 6 uneven
chunks), and the bytes of each step are the formulas again; what cannot work is refused before any
process starts.
"""
import pytest
import workers_cp
from reference import assert_same_training, flat, rel_diff

import minipar
from minipar import context_parallel as cpm
from minipar.config import ParallelConfig

CASES = [("ring", 2, 12, 4, 2, True), ("ring", 3, 13, 6, 3, True), ("ring", 3, 11, 6, 2, False),
         ("ring", 4, 17, 4, 1, True), ("all-gather", 2, 12, 4, 2, True),
         ("all-gather", 3, 13, 6, 3, True), ("all-gather", 3, 10, 6, 2, False),
         ("ulysses", 2, 12, 4, 2, True), ("ulysses", 3, 13, 6, 3, True),
         ("ulysses", 3, 7, 3, 3, False)]


@pytest.mark.parametrize("method,cp,seq_len,hq,hk,balanced", CASES)
def test_every_method_equals_single_device_attention_and_sends_what_it_says(
        method, cp, seq_len, hq, hk, balanced):
    ranks = minipar.launch(workers_cp.attention_errors, cp, method, seq_len, hq, hk, balanced,
                           timeout=120)
    for rank, (errors, sent, calls) in enumerate(ranks):
        assert max(errors.values()) < 1e-12, (rank, errors)
        assert sent == cpm.sent(method, seq_len, cp, rank, 2, hq, hk, 8, 8, balanced), rank


def test_the_balanced_split_evens_out_the_causal_work():
    for cp, seq_len in ((2, 64), (4, 1024), (3, 1000)):
        balanced = [cpm.causal_pairs(seq_len, cp, r) for r in range(cp)]
        contiguous = [cpm.causal_pairs(seq_len, cp, r, balanced=False) for r in range(cp)]
        total = seq_len * (seq_len + 1) // 2
        assert sum(balanced) == sum(contiguous) == total
        assert max(balanced) / min(balanced) < 1.01   # every rank about T^2 / (2 cp)
        assert max(contiguous) / min(contiguous) > 2 * cp - 1.5   # the last rank's vs the first's


def test_positions_cover_the_sequence_once():
    for cp, seq_len in ((1, 5), (2, 4), (3, 13), (4, 17)):
        for balanced in (True, False):
            held = sorted(int(p) for r in range(cp)
                          for p in cpm.positions(seq_len, cp, r, balanced))
            assert held == list(range(seq_len))
    assert cpm.positions(8, 2, 0).tolist() == [0, 1, 6, 7]   # chunks 0 and 3 of 4


@pytest.mark.parametrize("args,message", [((3, 2, 0), "shorter than the 4 chunks"),
                                          ((8, 0, 0), "positive integer"),
                                          ((8, 2, 2), "rank in")])
def test_a_split_that_cannot_work_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        cpm.positions(*args)


def test_pytorchs_context_parallel_does_not_run_on_this_cpu():
    # the peer of the bench: torch.distributed.tensor.experimental.context_parallel replaces the
    # CUDA SDPA kernels (flash, efficient, cuDNN) with its ring; on a CPU the SDPA op it meets has
    # no sharding rule, and the math backend mixes plain tensors with DTensors. When a torch runs
    # it here, this test fails: then compare it side by side (bench/)
    flash, math = (minipar.launch(workers_cp.torch_context_parallel, 2, m, timeout=120)[0]
                   for m in (False, True))
    assert "_scaled_dot_product_flash_attention_for_cpu" in flash and "sharding" in flash
    assert "mixed torch.Tensor and DTensor" in math


# ------------------------------------------------------------------- training, every layout

TINY = minipar.GPTConfig.preset("tiny")          # 4 layers, 4 heads, h 64, s 64
KW = dict(steps=3, global_batch=8, lr=1e-3, weight_decay=0.1, seed=0, return_state=True)
LAYOUTS = [ParallelConfig(cp=2), ParallelConfig(cp=3, cp_method="all-gather"),
           ParallelConfig(cp=2, cp_method="ulysses"), ParallelConfig(cp=2, dp=2),
           ParallelConfig(cp=2, zero=1, microbatches=2),
           ParallelConfig(cp=3, recompute="selective"),
           ParallelConfig(cp=2, cp_method="all-gather", zero=2, recompute="full"),
           ParallelConfig(cp=2, tp=2), ParallelConfig(cp=2, tp=2, cp_method="ulysses"),
           ParallelConfig(cp=3, tp=2, cp_method="all-gather", dp_mode="naive"),
           ParallelConfig(cp=2, zero=3), ParallelConfig(cp=3, zero=3, recompute="full"),
           ParallelConfig(cp=2, pp=2, microbatches=2),
           ParallelConfig(cp=3, pp=2, microbatches=4, schedule="interleaved-1f1b",
                          virtual_stages=2, cp_method="all-gather"),
           ParallelConfig(cp=2, tp=2, sequence_parallel=True),
           ParallelConfig(cp=2, tp=2, sequence_parallel=True, cp_method="ulysses")]


@pytest.fixture(scope="module")
def reference():
    return minipar.train(TINY, ParallelConfig(), **KW)


@pytest.mark.parametrize("par", LAYOUTS, ids=[par.label for par in LAYOUTS])
def test_training_with_context_parallelism_is_the_single_process_run(par, reference):
    res = minipar.train(TINY, par, **KW)
    assert_same_training(res, reference)
    b = KW["global_batch"] // (par.dp * par.microbatches)   # rows of a micro-batch
    kinds = {"ring": ["cp_ring"], "all-gather": ["all_gather", "reduce_scatter"],
             "ulysses": ["cp_all_to_all"]}[par.cp_method]
    heads = 4 // par.tp   # a TP rank's
    for rank, sent in enumerate(res.comm_bytes):   # tp innermost, then cp
        cp_rank = rank // par.tp % par.cp
        formula = cpm.sent(par.cp_method, 64, par.cp, cp_rank, b, heads, heads, 16, 4)
        recomputed = 2 if par.recompute != "none" else 1   # the forward's exchanges again
        forward = cpm.sent(par.cp_method, 64, par.cp, cp_rank, b, heads, heads, 16, 4,
                           backward=False)
        for kind in kinds:
            per_layer = formula[kind] + (recomputed - 1) * forward.get(kind, 0)
            if (par.zero or par.tp > 1) and kind in ("all_gather", "reduce_scatter"):
                continue   # ZeRO's and TP's own gathers share the names (their tests count them)
            layers = TINY.n_layer // par.pp   # this rank's
            assert sent[kind] == KW["steps"] * par.microbatches * layers * per_layer, kind


@pytest.mark.parametrize("par,cfg,message", [
    (dict(cp=3, tp=2, sequence_parallel=True), TINY, "\\[21, 21, 22\\].* divide by tp"),
    (dict(cp=2, tp=2, cp_method="ulysses"), TINY.replace(n_kv_head=2), "cp \\* tp"),
    (dict(cp_method="star"), TINY, "cp_method"),
    (dict(cp=5), TINY.replace(seq_len=9), "seq_len must be >= 10"),
    (dict(cp=3, cp_method="ulysses"), TINY, "n_head \\(4\\) and n_kv_head \\(4\\) must divide"),
    (dict(cp=2), TINY.replace(dropout=0.1), "dropout 0")])
def test_a_context_parallel_layout_that_cannot_work_is_refused_before_any_process(par, cfg,
                                                                                  message):
    with pytest.raises(ValueError, match=message):
        minipar.train(cfg, ParallelConfig(**par), steps=1, global_batch=4)


def test_a_checkpoint_resumes_from_one_context_parallel_layout_in_another(tmp_path, reference):
    path = str(tmp_path / "cp.pt")
    minipar.train(TINY, ParallelConfig(cp=2, zero=1), **{**KW, "steps": 2}, save=path)
    rest = minipar.train(TINY, ParallelConfig(cp=3, cp_method="all-gather"), **KW, resume=path)
    assert len(rest.losses) == 1 and rest.losses[0] == pytest.approx(reference.losses[2], rel=1e-5)
    assert rel_diff(flat(rest.state_dict), flat(reference.state_dict)) <= 1e-5


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallelism_in_bf16_keeps_to_the_16_bit_bounds(method):
    # test_precision_dp's bounds: losses within 1e-4, the whole model within 2e-3 (the 16-bit
    # matmuls of part of a sequence need not round like those of the whole)
    kw = dict(KW, steps=4)
    ref = minipar.train(TINY, ParallelConfig(precision="bf16"), **kw)
    got = minipar.train(TINY, ParallelConfig(precision="bf16", cp=2, cp_method=method), **kw)
    assert max(abs(a - b) / b for a, b in zip(got.losses, ref.losses)) < 1e-4
    assert rel_diff(flat(got.state_dict), flat(ref.state_dict)) < 2e-3
