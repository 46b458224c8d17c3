"""The analytic memory model (memory.predict) against what training measures, and against the ZeRO paper.

How close, and why not closer:
  params, grads, comm   equal to the byte, padding included (predict pads the flat buffers as zero.py does)
  optimizer             predicted + 4 bytes per step counter (one per parameter, or piece of one, a rank
                        updates): 0 <= measured - predicted <= 4 x (parameter tensors)
  activations           equal to the byte
"""
import pytest
import torch
import workers_dp

import minipar
from minipar import GPTConfig, ParallelConfig, data, memory, traffic
from minipar.model import cross_entropy

ODD = GPTConfig.preset("tiny", vocab_size=97)   # 216,353 parameters: every flat buffer pads at dp = 2, 3
STEPS, BATCH = 1, 12
N_TENSORS = len(list(minipar.GPT(ODD).parameters()))


def check(cfg, par, measured_by_rank):
    for rank, measured in enumerate(measured_by_rank):
        predicted = memory.predict(cfg, par, BATCH, rank=rank)
        for cat in ("params", "grads", "comm"):
            assert measured[cat] == predicted[cat], (par.label, rank, cat)
        extra = measured["optimizer"] - predicted["optimizer"]
        assert extra % 4 == 0 and 0 <= extra <= 4 * N_TENSORS, (par.label, rank, extra)
        assert measured["activations"] == predicted["activations"], (par.label, rank)


def variants(dp):
    cases = [ParallelConfig(dp=dp, zero=stage) for stage in range(4)]
    cases += [ParallelConfig(dp=dp, zero=stage, microbatches=2) for stage in (2, 3)]
    # 16 bits: the ZeRO paper's 2 + 2 + 12 bytes a parameter (bf16 with fp32 masters), and 2 + 2 + 4
    return cases + [ParallelConfig(dp=dp, zero=stage, precision=p) for p in ("bf16", "pure-bf16") for stage in range(4)]


def test_one_process_every_stage():
    for par in variants(1)[:5]:
        res = minipar.train(ODD, par, steps=STEPS, global_batch=BATCH)
        check(ODD, par, res.peak_memory)


@pytest.mark.parametrize("dp", [2, 3])
def test_predicted_equals_measured(dp):
    cases = variants(dp) + [ParallelConfig(dp=dp, dp_mode="naive")]
    ranks = minipar.launch(workers_dp.train_variants, dp, ODD, cases, STEPS, BATCH, timeout=120)
    for i, par in enumerate(cases):
        check(ODD, par, [r[i].memory for r in ranks])
        predicted = traffic.dp(ODD, par)
        for r in ranks:
            sent = {k: v / STEPS for k, v in r[i].comm.items()}
            if par.precision != "fp32":
                continue  # traffic.dp counts fp32 bytes
            if par.zero:  # the ZeRO collectives are exact: every buffer divides by dp
                assert sent == predicted, par.label
            else:  # a ring all-reduce of a length not divisible by dp: a few elements more or less
                slack = 4 * r[i].calls["all_reduce"]
                assert abs(sent["all_reduce"] - predicted["all_reduce"]) <= slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_of_another_shape_in_16_and_32_bits(dtype):
    cfg = GPTConfig(n_layer=3, n_head=3, d_model=48, vocab_size=50, seq_len=32)
    b = 3
    torch.manual_seed(0)
    model = minipar.GPT(cfg).to(dtype)
    x, y = data.global_batch("synthetic", 0, b, cfg.seq_len, cfg.vocab_size)  # their own storage
    meter = memory.ActivationMeter()
    with meter:
        loss = cross_entropy(model(x), y)
    loss.backward()
    assert meter.peak == sum(memory.activations(cfg, b, dtype.itemsize).values())
    paper = memory.korthikanti(cfg, b, dtype.itemsize)   # the paper's layers: dropout masks, s^2 matrix
    assert memory.activations(cfg, b, dtype.itemsize)["layers"] < paper


def test_model_states_by_the_zero_formulas():
    psi, n = 1000, 4
    fp32 = {s: memory.model_states(psi, n, s, memory.FP32) for s in range(4)}
    assert fp32[0] == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert fp32[1] == {"params": 4000, "grads": 4000, "optimizer": 2000}
    assert fp32[2] == {"params": 4000, "grads": 1000, "optimizer": 2000}
    assert fp32[3] == {"params": 1000, "grads": 1000, "optimizer": 2000}
    mixed = memory.predict(ODD, ParallelConfig(dp=2, zero=3, precision="bf16"), BATCH)
    fp = memory.predict(ODD, ParallelConfig(dp=2, zero=3), BATCH)
    assert (mixed["params"], mixed["grads"], mixed["optimizer"]) == \
           (fp["params"] // 2, fp["grads"], fp["optimizer"] * 3 // 2)  # fp32 gradients
    half = memory.predict(ODD, ParallelConfig(dp=2, zero=3, precision="bf16", reduce_fp32=False),
                          BATCH)
    assert half["grads"] == fp["grads"] // 2  # the ZeRO paper's 16-bit gradients


PAPER = {  # ZeRO paper Table I, 7.5B parameters, K = 12: GB per device for stages 1, 2, 3
    1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
    1024: (30.1, 15.1, 0.12)}


@pytest.mark.parametrize("n_d", PAPER)
def test_zero_table_reproduces_the_paper(n_d):
    table = memory.zero_table(7.5e9, n_d)
    assert table[0] == pytest.approx(120)   # plain DP: 16 Psi, whatever N_d
    for stage, paper in zip((1, 2, 3), PAPER[n_d]):   # to the paper's last digit, rounding half up
        last = 10.0 ** -len(f"{paper}".partition(".")[2].rstrip("0") or "")
        assert paper - last / 2 <= table[stage] < paper + last / 2, (n_d, stage, table[stage])


def _assert_peaks(cfg, layouts, batch: int) -> list[dict]:
    """Train `layouts` (one world size) in one launch and assert every rank's held peak, by category,
    equal to step_memory.predict_peak for its DP rank and stage, and its phase too without a pipeline
    (the executor's phases are not named); and its tally equal to memory.predict's (`check`'s
    rules); returns the predictions."""
    from minipar.mesh import Mesh
    from minipar.step_memory import predict_peak
    world, wants = layouts[0].world, []
    ranks = minipar.launch(workers_dp.train_variants, world, cfg, layouts, 2, batch, timeout=300)
    for i, par in enumerate(layouts):
        for r in range(world):
            at = Mesh(par.dp, par.tp, par.pp, rank=r).coords()
            want = predict_peak(cfg, par, batch, rank=at.dp_rank, pp_rank=at.pp_rank)
            keys = memory.CATEGORIES if par.pp > 1 else want
            got = ranks[r][i].step_memory["held"]
            assert {c: got[c] for c in keys} == {c: want[c] for c in keys}, (par.label, r)
            wants.append(want)
            tally = memory.predict(cfg, par, batch, rank=at.dp_rank, pp_rank=at.pp_rank)
            measured = ranks[r][i].memory
            for c in ("params", "grads", "comm", "activations"):
                assert measured[c] == tally[c], (par.label, r, c)
            extra = measured["optimizer"] - tally["optimizer"]  # AdamW's step counters
            assert extra % 4 == 0 and 0 <= extra <= 4 * N_TENSORS, (par.label, r, extra)
    return wants


@pytest.mark.parametrize("dp", [2, 3])
def test_the_step_peak_is_predicted_to_the_byte(dp):
    """The most a rank holds over a whole step (measured from tensor lifetimes, minipar.tracker:
    model states, gradient buffers, communication buffers and activations; autograd's temporaries
    aside) equals step_memory.predict_peak, moment and bytes, for every ZeRO stage and DP mode
    (buckets of 0.1 MiB: many; 25 MiB: one), fp32 and bf16 (fp32 or 16-bit gradients), with and
    without accumulation."""
    modes = ({"dp_mode": "naive"}, {"bucket_mb": 0.1}, {})
    cases = [ParallelConfig(dp=dp, zero=z, precision=p, reduce_fp32=fp32_grads, microbatches=m,
                            **mode)
             for p, fp32_grads in (("fp32", True), ("bf16", True), ("bf16", False))
             for z in (0, 1, 2, 3) for mode in (modes[2:] if z == 3 else modes) for m in (1, 2)]
    phases = {want["phase"] for want in _assert_peaks(ODD, cases, BATCH)}
    assert phases == {"forward", "backward"}  # ZeRO-2 naive, one micro-batch: at its first gradient


def test_the_step_peak_with_tensor_parallelism_is_predicted_to_the_byte():
    """ZeRO 1-3 with TP (dp 2 x tp 2; a vocabulary TP cuts, 111,153 parameters a TP rank: the flat
    buffers pad): what lies between the column- and row-parallel linears is cut t ways, a
    row-parallel bias's gradient arrives first, the vocab-parallel loss keeps its targets' shard
    and mask and returns its fp32 softmax in place as the logits' gradient (alive until the head's
    backward, or its cast to bf16), the embedding keeps its local ids and mask; with SP the
    LayerNorms keep sequence shards and one node gives q, k, v (or fc) their gradients. Every DP
    mode, fp32 and bf16 with 16-bit gradients, accumulation, each recomputation, on every rank
    (the walk's DP rank: rank // tp). Measured at 104 such layouts, 416 rank-cases, all equal."""
    cfg = GPTConfig.preset("tiny", vocab_size=98)
    cases = [ParallelConfig(dp=2, tp=2, zero=z, sequence_parallel=sp, **kw) for z in (1, 2)
             for sp in (False, True) for kw in (
                 dict(microbatches=2, bucket_mb=0.1),
                 dict(precision="bf16", reduce_fp32=False, dp_mode="naive", recompute="full"),
                 dict(recompute="selective"))]
    cases += [ParallelConfig(dp=2, tp=2, zero=3, **kw) for kw in (
        dict(), dict(precision="bf16", reduce_fp32=False, recompute="selective", microbatches=2),
        dict(recompute="full"))]
    llama = GPTConfig.preset("llama-tiny", vocab_size=98)   # SwiGLU, grouped-query attention
    llama_cases = [ParallelConfig(dp=2, tp=2, zero=z, sequence_parallel=sp, bucket_mb=0.02)
                   for z, sp in ((1, False), (2, False), (2, True))] + [ParallelConfig(dp=2, tp=2, zero=3)]
    for model, layouts in ((cfg, cases), (llama, llama_cases)):
        _assert_peaks(model, layouts, BATCH)


def test_the_step_peak_of_a_pipeline_stage_with_zero_is_predicted_to_the_byte():
    """ZeRO with a pipeline (dp 2 x pp 2): each stage walks its schedule's actions, a forward
    saving its chunk's activations, a backward freeing them node by node while its gradients fill
    the stage's buckets; the step runs in no_sync, so ZeRO-1 reduces only in finish and ZeRO-2
    every micro-batch; ZB-H1's W gives a chunk's gradients module by module
    (autograd_events.weight_order), its graph freed at W's end. ZeRO-3 gathers and frees the
    stage's units action by action, a prefetch crossing into the rank's other chunk with
    interleaving (held until its turn). GPipe, 1F1B, interleaved 1F1B and ZB-H1, every DP mode,
    bf16 with 16-bit gradients, recomputation, and with TP (and SP) too, dp 2 x tp 2 x pp 2, GPT
    and Llama shapes, dp 3; every rank (the walk's: its DP rank and stage)."""
    batch = 16
    cases = [ParallelConfig(dp=2, pp=2, zero=z, microbatches=4, **kw) for z in (1, 2) for kw in (
        dict(bucket_mb=0.05), dict(schedule="gpipe", dp_mode="naive"),
        dict(schedule="interleaved-1f1b", virtual_stages=2, bucket_mb=0.05),
        dict(schedule="zb-h1", bucket_mb=0.05))]
    cases += [ParallelConfig(dp=2, pp=2, zero=3, microbatches=4, schedule=s,
                             virtual_stages=1 + (s == "interleaved-1f1b"))
              for s in ("gpipe", "1f1b", "interleaved-1f1b")]
    cases += [ParallelConfig(dp=2, pp=2, zero=z, microbatches=2, precision="bf16", reduce_fp32=False,
                             recompute=rc, bucket_mb=0.05 if z == 2 else 25)
              for z, rc in ((2, "full"), (3, "selective"))]
    short = ODD.replace(seq_len=8)  # activations far below the buffers: the ring's space decides
    with_tp = [ParallelConfig(dp=2, tp=2, pp=2, zero=z, microbatches=4, sequence_parallel=z == 2,
                              bucket_mb=0.05, schedule=schedule) for z in (1, 2)
               for schedule in ("1f1b", "zb-h1")] + \
        [ParallelConfig(dp=2, tp=2, pp=2, zero=3, microbatches=4, schedule="interleaved-1f1b",
                        virtual_stages=2)]
    llama = GPTConfig.preset("llama-tiny", vocab_size=98)  # W's order decides its buckets' peak
    llama_zb = [ParallelConfig(dp=2, tp=2, pp=2, zero=2, microbatches=4, schedule="zb-h1",
                               sequence_parallel=True, bucket_mb=0.02, precision="bf16")]
    for cfg, layouts in ((ODD, cases), (short, [ParallelConfig(dp=2, pp=2, zero=z, microbatches=4,
                                                               bucket_mb=0.2) for z in (1, 2)]),
                         (ODD.replace(vocab_size=98), with_tp), (llama, llama_zb)):
        _assert_peaks(cfg, layouts, batch)
    odd_dp = ParallelConfig(dp=3, pp=2, zero=3, microbatches=4, schedule="interleaved-1f1b",
                            virtual_stages=2, precision="bf16")
    _assert_peaks(llama, [odd_dp], 24)


LLAMA_SHAPE = dict(mlp="swiglu", n_kv_head=2, ffn_hidden=128)
TP_RANKS = pytest.mark.parametrize("t,sp", [(1, False), (2, False), (2, True)],
                                   ids=["t1", "t2", "t2-sp"])


def _tp_rank_model(shape: dict, t: int, sp: bool):
    """(cfg, model, loss_fn) of one TP rank of a 2-block model (collectives local: layer_profile's;
    t = 1: the plain GPT)."""
    from minipar.planner.layer_profile import _local_tp
    from minipar.tensor_parallel import apply_tp, vocab_parallel_cross_entropy
    cfg = GPTConfig.preset("tiny", vocab_size=98, n_layer=2, **shape)
    torch.manual_seed(0)
    if t == 1:
        return cfg, minipar.GPT(cfg), cross_entropy
    tp = _local_tp(t, sp)
    return cfg, apply_tp(minipar.GPT(cfg), tp), \
        lambda logits, y: vocab_parallel_cross_entropy(logits, y, tp)


@pytest.mark.parametrize("shape", [{}, LLAMA_SHAPE, dict(tie_embeddings=True)],
                         ids=["gpt", "llama", "tied"])
@TP_RANKS
def test_gradients_reach_their_parameters_in_the_walks_order(shape, t, sp):
    """The step-peak walks (minipar.autograd_events) assume the order in which autograd
    finishes each parameter's gradient, the order gradient buckets fill in: a LayerNorm's weight
    before its bias, a linear's bias before its weight, under TP a row-parallel bias from a node of
    its own, with SP the one node of q, k, v in autograd's own order; and what each node frees
    before its gradients arrive. Hooks on a TP rank's model (collectives local: layer_profile's)
    record each parameter's turn and the activations then still saved (minipar.tracker)."""
    from minipar.autograd_events import backward_events
    from minipar.tracker import Tracker
    cfg, model, loss_fn = _tp_rank_model(shape, t, sp)
    order = []
    with Tracker(known={"params": list(model.parameters())}) as tracker:
        x, y = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)) for _ in range(2))  # as train's
        for i, p in enumerate(model.parameters()):  # (parameter, activations still saved)
            p.register_post_accumulate_grad_hook(
                lambda _, i=i: order.append((i, tracker.current["activations"])))
        loss = loss_fn(model(x), y)
        saved = tracker.current["activations"]
        loss.backward()
    walk = []
    for freed, params in backward_events(cfg, 2, 4, "none", t, sp):
        saved -= freed
        walk += [(i, saved) for i in params]
    assert order == walk


@pytest.mark.parametrize("shape", [{}, LLAMA_SHAPE], ids=["gpt", "llama"])
@TP_RANKS
def test_a_split_backward_gives_the_gradients_in_the_walks_order(shape, t, sp):
    """zb-h1's W runs one backward per module that owns weights, deepest first: the step-peak walk
    of its gradient buckets assumes that order (autograd_events.weight_order). Hooks on a one-rank
    pipeline's only chunk record each parameter's turn in its F, B, W."""
    from minipar.autograd_events import weight_order
    from minipar.pipeline.runtime import Chunk, PipelineExecutor
    from minipar.pipeline.schedules import Action
    cfg, model, loss_fn = _tp_rank_model(shape, t, sp)
    pipe = PipelineExecutor({0: Chunk(model, range(cfg.n_layer), True, True)},
                            [[Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0)]],
                            (2, cfg.seq_len, cfg.d_model), loss_fn=loss_fn)
    order = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
    x, y = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)) for _ in range(2))
    pipe.step([x], [y])
    assert order == weight_order(cfg, cfg.n_layer, True, True, t, sp)


def test_the_step_peak_with_recomputation_is_predicted_to_the_byte():
    """ZeRO 1-3 with recomputation: selective (the fused core keeps no log-sum-exp, recomputed
    with it) and full (only each block's input kept, freed by its last node; its re-run forward's
    tensors are temporaries), both DP modes, fp32 and bf16 with 16-bit gradients, with and without
    accumulation, dp 3."""
    cases = [ParallelConfig(dp=3, zero=z, precision=p, reduce_fp32=p == "fp32", microbatches=m,
                            recompute=rc, **mode)
             for p in ("fp32", "bf16") for z in (1, 2, 3)
             for mode in ({"dp_mode": "naive"}, {})[z == 3:] for m in (1, 2)
             for rc in ("selective", "full")]
    _assert_peaks(ODD, cases, 12)


MOE = GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=96, seq_len=24, n_expert=4, top_k=2)
EVEN = MOE.replace(top_k=4)   # every token to every expert: each EP rank takes as many rows as it sends


@pytest.mark.parametrize("cfg,par", [
    (ODD, ParallelConfig(cp=2)), (ODD, ParallelConfig(cp=3, cp_method="all-gather")),
    (ODD.replace(vocab_size=96), ParallelConfig(cp=2, tp=2, cp_method="ulysses")),
    (ODD, ParallelConfig(cp=2, dp=2, zero=2, cp_method="all-gather", precision="bf16")),
    (ODD, ParallelConfig(cp=3, recompute="selective")),
    (ODD, ParallelConfig(cp=2, pp=2, microbatches=3, zero=3)),
    (ODD.replace(vocab_size=96), ParallelConfig(cp=2, tp=2, sequence_parallel=True)),
    (MOE, ParallelConfig(microbatches=2)), (MOE.replace(mlp="swiglu", capacity_factor=0.5),
                                            ParallelConfig(precision="bf16")),
    (MOE, ParallelConfig(dp=2, zero=3)), (EVEN, ParallelConfig(dp=4, ep=2, dp_mode="naive")),
    (EVEN, ParallelConfig(dp=2, ep=2, pp=2, microbatches=2)),
    (EVEN, ParallelConfig(dp=2, ep=2, tp=2, precision="bf16"))],
    ids=lambda x: x.label if isinstance(x, ParallelConfig) else "")
def test_context_and_expert_parallel_ranks_are_predicted_to_the_byte(cfg, par):
    """Each CP rank's activations are the one-device model's at the tokens it holds, plus what its
    attention gathers (all-gather) or sends home (Ulysses); its states those of a DP replica over
    dp x cp. A MoE layer's activations follow its token-slots and rows (capacity 0.5: every expert
    fills); an EP rank holds n / ep experts and its experts' buckets reduce over dp / ep ranks."""
    res = minipar.train(cfg, par, steps=STEPS, global_batch=BATCH)
    tensors = len(list(minipar.GPT(cfg).parameters()))
    for rank, (measured, predicted) in enumerate(zip(res.peak_memory, res.predicted_memory)):
        for cat in ("params", "grads", "comm", "activations"):
            assert measured[cat] == predicted[cat], (rank, cat)
        extra = measured["optimizer"] - predicted["optimizer"]
        assert extra % 4 == 0 and 0 <= extra <= 4 * tensors, (rank, extra)
