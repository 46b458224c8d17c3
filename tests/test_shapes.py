"""Today's model shapes (grouped-query attention, SwiGLU, an FFN width of its own, tied embeddings):
every technique trains them as the single process does, with the memory predicted as measured.

World 4 and world 3 (odd), each layout in one launch; fp32, judged as tests/reference.py judges.
The shapes are chosen so that nothing divides by accident: 8 query heads on 4 key/value heads (tp 2,
4) and 6 on 3 (tp 3), an FFN width that is not 4 h, a vocabulary of 96.
"""
import pytest
import torch
from reference import assert_same_training

import minipar
from minipar import GPTConfig, ParallelConfig, data, memory
from minipar.lessons import demos_3d
from minipar.model import cross_entropy
from minipar.step_memory import predict_peak

STEPS, BATCH = 2, 24
SHAPES = {
    4: GPTConfig(n_layer=4, n_head=8, n_kv_head=4, d_model=48, ffn_hidden=120, vocab_size=96,
                 seq_len=48, mlp="swiglu"),
    3: GPTConfig(n_layer=3, n_head=6, n_kv_head=3, d_model=48, ffn_hidden=90, vocab_size=96,
                 seq_len=48),
}
LAYOUTS = {
    4: [ParallelConfig(dp=4, zero=1), ParallelConfig(dp=4, zero=3, microbatches=2),
        ParallelConfig(dp=2, tp=2, sequence_parallel=True, zero=2),
        ParallelConfig(tp=4, recompute="selective"),
        ParallelConfig(tp=2, pp=2, microbatches=2, schedule="zb-h1"),
        ParallelConfig(dp=2, pp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2,
                       recompute="full")],
    3: [ParallelConfig(dp=3, zero=2, dp_mode="naive"), ParallelConfig(tp=3, sequence_parallel=True),
        ParallelConfig(pp=3, microbatches=3, schedule="1f1b"), ParallelConfig(dp=3, zero=3)],
}
TIED = [ParallelConfig(dp=4, zero=1), ParallelConfig(dp=2, tp=2, sequence_parallel=True, zero=2),
        ParallelConfig(tp=4, recompute="full"), ParallelConfig(dp=4, bucket_mb=0.05)]
N_TENSORS = 2 + 14 * 4 + 4   # most parameter tensors of the shapes above (untied GELU)


def check_memory(cfg, par, ranks):
    """Params, grads and buffers to the byte; the optimizer's step counters (4 bytes a tensor, or
    piece of one) aside; the activations to the byte."""
    for rank, (predicted, run) in enumerate(zip(memory.predict_ranks(cfg, par, BATCH), ranks)):
        measured = run.memory
        for cat in ("params", "grads", "comm", "activations"):
            assert measured[cat] == predicted[cat], (par.label, rank, cat)
        extra = measured["optimizer"] - predicted["optimizer"]
        assert extra % 4 == 0 and 0 <= extra <= 4 * N_TENSORS, (par.label, rank, extra)


def test_the_parameter_count_and_flops_follow_the_shape():
    for cfg in [*SHAPES.values(), SHAPES[4].replace(tie_embeddings=True),
                GPTConfig.preset("llama-tiny"), GPTConfig.preset("tiny")]:
        assert sum(p.numel() for p in minipar.GPT(cfg).parameters()) == cfg.num_params
    gpt = GPTConfig.preset("gpt2-medium")  # Korthikanti's eq. 7 for the GPT shape
    l, h, s, V = gpt.n_layer, gpt.d_model, gpt.seq_len, gpt.vocab_size
    assert gpt.flops_per_token == pytest.approx(72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)))
    llama = GPTConfig.preset("llama3-8b")  # Llama 3 8B: 8.03e9 with RoPE (no learned positions)
    assert llama.num_params - llama.seq_len * llama.d_model == pytest.approx(8.03e9, rel=0.001)
    assert GPTConfig.preset("llama3-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert GPTConfig.preset("llama3-405b").num_params == pytest.approx(405.9e9, rel=0.01)


def test_gqa_is_attention_with_each_key_value_head_repeated():
    """Grouped-query attention equals full attention whose k and v repeat each head n_head/n_kv
    times: query head i reads key/value head i // (n_head / n_kv)."""
    cfg = SHAPES[4]
    torch.manual_seed(0)
    gqa, full = minipar.GPT(cfg), minipar.GPT(cfg.replace(n_kv_head=None))
    with torch.no_grad():
        for name, p in full.named_parameters():
            src = gqa.get_parameter(name)
            if name.endswith(("attn.k.weight", "attn.v.weight", "attn.v.bias")):
                heads = src.reshape(cfg.kv_heads, -1, *src.shape[1:])
                src = heads.repeat_interleave(cfg.n_head // cfg.kv_heads, 0).reshape(p.shape)
            p.copy_(src)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    torch.testing.assert_close(gqa(x), full(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, rule", [
    (dict(n_kv_head=3), "must divide by n_kv_head"), (dict(mlp="relu"), "mlp"),
    (dict(ffn_hidden=0), "ffn_hidden"), (dict(tie_embeddings=1), "tie_embeddings")])
def test_a_shape_that_cannot_work_is_named(bad, rule):
    with pytest.raises(ValueError, match=rule):
        SHAPES[4].replace(**bad)


@pytest.mark.parametrize("cfg, par, rule", [
    (SHAPES[4], ParallelConfig(tp=16), "n_head"),
    (SHAPES[4].replace(n_kv_head=2), ParallelConfig(tp=4), "n_kv_head .*does not replicate"),
    (SHAPES[4].replace(ffn_hidden=122), ParallelConfig(tp=4), "ffn_hidden"),
    (SHAPES[4].replace(tie_embeddings=True), ParallelConfig(pp=2), "embedding group"),
    (SHAPES[4].replace(tie_embeddings=True), ParallelConfig(dp=2, zero=3), "two units")])
def test_a_layout_the_shape_does_not_admit_is_named(cfg, par, rule):
    with pytest.raises(ValueError, match=rule):
        par.check(cfg, BATCH)


def test_a_worker_names_the_rule_too():
    """train_layouts (tests, the calibration) and torchrun reach train_rank without train()'s checks:
    it checks the layout itself, on every rank. ZeRO-3 with a tied head crashed a rank (SIGSEGV)."""
    import workers_dp
    with pytest.raises(minipar.WorkerError, match="two units"):
        minipar.launch(workers_dp.train_variants, 2, SHAPES[4].replace(tie_embeddings=True),
                       [ParallelConfig(dp=2, zero=3)], 1, BATCH, timeout=60)


def test_the_activations_are_counted_for_each_shape():
    for cfg in (*SHAPES.values(), SHAPES[4].replace(tie_embeddings=True)):
        torch.manual_seed(0)
        model = minipar.GPT(cfg)
        x, y = data.global_batch("synthetic", 0, 3, cfg.seq_len, cfg.vocab_size)  # two storages
        meter = memory.ActivationMeter()
        with meter:
            loss = cross_entropy(model(x), y)
        loss.backward()
        assert meter.peak == sum(memory.activations(cfg, 3, 4).values())


def reference(cfg):
    return minipar.train(cfg, ParallelConfig(), steps=STEPS, global_batch=BATCH, lr=1e-3,
                         weight_decay=0.1, seed=0, return_state=True)


@pytest.mark.slow
@pytest.mark.parametrize("world, tied", [(4, False), (3, False), (4, True)])
def test_every_technique_trains_the_shape_as_one_process(world, tied):
    cfg = SHAPES[world].replace(tie_embeddings=tied)
    layouts = TIED if tied else LAYOUTS[world]
    for par in layouts:
        par.check(cfg, BATCH)
    ranks = minipar.launch(demos_3d.layouts, world, cfg, layouts, STEPS, BATCH, 1e-3, 0.1, None,
                           True, timeout=600)
    ref = reference(cfg)
    if tied:
        assert torch.equal(ref.state_dict["head.weight"], ref.state_dict["tok_emb.weight"])
    for i, par in enumerate(layouts):
        try:
            assert_same_training(ranks[0][i], ref)
        except AssertionError as e:
            raise AssertionError(f"{par.label}: {e}") from None
        check_memory(cfg, par, [r[i] for r in ranks])


@pytest.mark.slow
def test_the_step_peak_of_the_shapes_is_predicted_to_the_byte():
    """step_memory.predict_peak walks backward node by node: SwiGLU's and GQA's nodes, and a tied
    head whose gradient arrives with the embedding's, each move it."""
    import workers_dp
    cases = [ParallelConfig(dp=2, zero=z, precision=p, **({} if z == 3 else dict(bucket_mb=0.05)))
             for z in (0, 1, 2, 3) for p in ("fp32", "bf16")]
    for cfg, pars in ((SHAPES[4], cases), (SHAPES[3].replace(tie_embeddings=True),
                                           [p for p in cases if p.zero < 3])):
        ranks = minipar.launch(workers_dp.train_variants, 2, cfg, pars, 2, BATCH, timeout=300)
        for i, par in enumerate(pars):
            for r in range(2):
                got, want = ranks[r][i].step_memory["held"], predict_peak(cfg, par, BATCH, rank=r)
                assert {c: got[c] for c in want} == want, (par.label, r)
